"""``tf.train.Example`` as protobuf classes, for tests that make records and hold
``pstrain.data.parse_example`` (which reads the wire format itself) to protobuf's own
parse: ``example.proto`` and ``feature.proto`` declared in a pool of their own."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory


def example_class() -> Any:
    """The ``tensorflow.Example`` message class."""
    types = descriptor_pb2.FieldDescriptorProto
    optional, repeated, message = types.LABEL_OPTIONAL, types.LABEL_REPEATED, types.TYPE_MESSAGE
    f = descriptor_pb2.FileDescriptorProto(
        name="tests_tf_example.proto", package="tensorflow", syntax="proto3"
    )
    for name, kind in (
        ("BytesList", types.TYPE_BYTES),
        ("FloatList", types.TYPE_FLOAT),
        ("Int64List", types.TYPE_INT64),
    ):
        field = f.message_type.add(name=name).field.add(name="value", number=1, label=repeated, type=kind)
        if kind != types.TYPE_BYTES:
            field.options.packed = True
    feature = f.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, kind) in enumerate(
        (("bytes_list", "BytesList"), ("float_list", "FloatList"), ("int64_list", "Int64List")), 1
    ):
        feature.field.add(
            name=name,
            number=number,
            type=message,
            type_name=f".tensorflow.{kind}",
            oneof_index=0,
            label=optional,
        )
    features = f.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=types.TYPE_STRING, label=optional)
    entry.field.add(name="value", number=2, type=message, type_name=".tensorflow.Feature", label=optional)
    features.field.add(
        name="feature", number=1, type=message, type_name=".tensorflow.Features.FeatureEntry", label=repeated
    )
    f.message_type.add(name="Example").field.add(
        name="features", number=1, type=message, type_name=".tensorflow.Features", label=optional
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))
