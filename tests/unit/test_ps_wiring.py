"""A ps is wired at construction: its parts get what they call (the tables' scopes, the
before images, the takeovers) when they are built, and read the ps's name from it, so a ps
that joined a job and was given another index answers as that one in every part."""

from __future__ import annotations

import functools

from pstrain._base.cluster import task_name
from pstrain.server.ps.handlers import ParameterServer


def test_a_renamed_ps_answers_as_its_new_index_in_every_part():
    ps = ParameterServer(0)
    ps.renamed(3)
    parts = [ps.store, ps.fencing, ps.feed, ps.table_handlers]
    assert {part.task for part in parts} == {task_name("ps", 3)} == {ps.task}
    assert ps.feed.index == 3 and not ps.answers_any_index


def test_the_fencing_of_a_ps_is_given_its_tables_scopes_and_before_images_when_built():
    ps = ParameterServer(0)
    scope = ps.fencing.scope_of
    assert isinstance(scope, functools.partial) and scope.args == (ps.table_handlers.guards, ps.feed)
    assert ps.fencing.before_update == ps.before_images.capture
    assert ps.table_handlers.as_of == ps.before_images.table_rows
    assert ps.table_handlers.on_takeover == ps.fencing.supersede
