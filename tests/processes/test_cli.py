"""`pstrain serve` as a real command: help, config sources, signals, refusals, TLS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import pytest

import pstrain
from pstrain._base.resolvers import parse_config
from pstrain._transport.channels import ps_advice
from pstrain.cli import main
from pstrain.cluster import listening_socket
from pstrain.errors import InvalidArgumentError, ProtocolError
from pstrain.server.config import client_ssl
from tests.helpers import TOKEN, ServeProcess, self_signed_cert

pytestmark = pytest.mark.timeout(60)


def run_cli(*args: str, env=None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pstrain.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_serve_help_documents_every_flag():
    out = run_cli("serve", "--help").stdout
    for flag in (
        "--role",
        "--index",
        "--cluster",
        "--host",
        "--port",
        "--token-file",
        "--tls-cert",
        "--tls-key",
        "--tls-ca",
        "--max-body",
        "--log-level",
        "--closure-threads",
    ):
        assert flag in out
    assert "TF_CONFIG" in out and "PSTRAIN_CONFIG" in out


def test_serve_starts_without_loading_the_coordinators_side():
    """Every task of a job runs `pstrain serve`: its parser (which holds `demo`'s too) must
    not load the coordinator, checkpoints or the dashboard, a second of start-up a process."""
    code = (
        "import sys\nfrom pstrain.cli import main\n"
        "try:\n    main(['serve', '--role', 'ps', '--port', 'x'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('pstrain._coordinator', "
        "'pstrain._checkpoint', 'pstrain.dashboard', 'pstrain.ctr'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "argument --port" in out.stderr, out.stderr  # the parser did run
    assert out.stdout.strip() == "[]", out.stdout


def test_refuses_a_public_address_without_a_token():
    result = run_cli("serve", "--role", "ps", "--index", "0", "--host", "0.0.0.0", "--port", "0")
    assert result.returncode == 2
    assert "refusing to listen on '0.0.0.0' without a cluster token" in result.stderr


def test_role_and_port_from_tf_config(tmp_path):

    with socket.socket() as s:  # a port for the config; the server binds it itself
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {
        "cluster": {"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]},
        "task": {"type": "ps", "index": 0},
    }

    env = dict(os.environ, TF_CONFIG=json.dumps(config))
    server = ServeProcess(env=env)
    try:
        assert server.address == f"127.0.0.1:{port}"
    finally:
        server.stop()
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(config))
    server = ServeProcess("--cluster", str(path), "--port", "0")
    try:
        assert server.address.startswith("127.0.0.1:")
    finally:
        server.stop()


def test_sigterm_and_sigint_stop_cleanly():
    # SIGTERM is a request to stop (0); SIGINT is Ctrl-C: 130, the status of an interrupted
    # program, with one line saying so
    for sig, status in ((signal.SIGTERM, 0), (signal.SIGINT, 130)):
        server = ServeProcess("--role", "ps", "--index", "0", "--port", "0")
        server.proc.send_signal(sig)
        assert server.proc.wait(15) == status
        said = [line for line in server.stderr().splitlines() if "interrupted (Ctrl-C)" in line]
        assert len(said) == (sig == signal.SIGINT), server.stderr()
        server.stop()


def test_bad_config_is_a_clear_error(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": {"ps": ["h:1"]}}))
    result = run_cli("serve", "--cluster", str(path))
    assert result.returncode == 2 and "There must be at least one worker" in result.stderr


async def test_tls(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    server = ServeProcess(
        "--role", "ps", "--index", "0", "--port", "0", "--tls-cert", str(cert), "--tls-key", str(key)
    )
    try:
        # HTTPS first: the ps sets its HTTP face up behind TLS for these (paused meanwhile).
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession() as session:

            async def get(path: str) -> int:
                async with session.get(
                    f"https://{server.address}{path}", ssl=client_ssl(str(cert)), headers=headers
                ) as r:
                    await r.read()
                    return r.status

            assert await asyncio.gather(get("/healthz"), get("/healthz"), get("/metrics")) == [200] * 3
        spec = {"ps": [server.address], "worker": ["127.0.0.1:9"]}
        resolver = pstrain.SimpleClusterResolver(spec, token=TOKEN)
        resolver.ssl_context = client_ssl(str(cert))
        strategy = pstrain.ParameterServerStrategy(resolver)
        async with strategy.scope():
            v = pstrain.Variable(np.arange(3.0), name="v")
        await v.assign_add(np.ones(3))
        np.testing.assert_array_equal(await v.numpy(), [1, 2, 3])
        plain = pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(spec, token=TOKEN))
        # A plain client to a TLS ps: the retries a starting ps gets end in the typed error.
        with pytest.raises(ProtocolError, match="expects TLS"):
            with plain.scope():
                w = pstrain.Variable(1.0, name="w")
            await plain.flush()
            del w
    finally:
        server.stop()


async def test_a_move_between_tls_ps_is_copied_over_tls_verified_with_tls_ca(tmp_path):
    """The ps a variable moves to asks its source for the copy over TLS, verifying it with
    its own ``--tls-ca``: the move goes through, and the value is whole where it went."""
    cert, key = self_signed_cert(tmp_path)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(cert))
    servers = [ServeProcess("--role", "ps", "--index", str(k), "--port", "0", *tls) for k in range(2)]
    try:
        spec = {"ps": [s.address for s in servers], "worker": ["127.0.0.1:9"]}
        resolver = pstrain.SimpleClusterResolver(spec, token=TOKEN)
        resolver.ssl_context = client_ssl(str(cert))
        strategy = pstrain.ParameterServerStrategy(resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        async with strategy.scope():
            with strategy.placement.colocated(0):
                v = pstrain.Variable(np.arange(1000.0), name="v")
        await coordinator.ps.move(["v"], 1)
        assert coordinator.ps.placement.ps_of("v", 0) == 1
        np.testing.assert_array_equal(await v.numpy(), np.arange(1000.0))
        # a ps serving TLS with no CA to verify the others with cannot take a move: it says so
        servers.append(ServeProcess("--role", "ps", "--index", "2", "--port", "0", *tls[:4]))
        await coordinator.ps.admit_ps(servers[2].address)
        with pytest.raises(
            pstrain.errors.FailedPreconditionError, match="serves TLS but has no CA.*--tls-ca"
        ):
            await coordinator.ps.move(["v"], 2)
        np.testing.assert_array_equal(await v.numpy(), np.arange(1000.0))
        await coordinator.close()
    finally:
        for s in servers:
            s.stop()


async def test_servers_leave_when_the_coordinators_job_is_done(tmp_path):
    """What ends a SLURM job: pstrain serve --exit-on-shutdown leaves on shutdown_cluster()."""

    reserved = [listening_socket("127.0.0.1", 0, "a test port") for _ in range(2)]
    ports = [s.getsockname()[1] for s in reserved]
    for s in reserved:
        s.close()
    spec = {"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
    config = tmp_path / "cluster.json"
    config.write_text(json.dumps({"cluster": spec}))
    ps = ServeProcess("--role", "ps", "--index", "0", "--cluster", str(config), "--exit-on-shutdown")
    worker = ServeProcess("--role", "worker", "--index", "0", "--cluster", str(config))  # no flag
    try:
        strategy = pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(spec, token=TOKEN))
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            v = pstrain.Variable(0.0)
        await coordinator.schedule(lambda: v.assign_add(1.0))
        stayed = await coordinator.shutdown_cluster()
        assert len(stayed) == 1 and "/job:worker/replica:0/task:0" in stayed[0]
        assert "--exit-on-shutdown" in stayed[0]
        code = await asyncio.get_running_loop().run_in_executor(None, lambda: ps.proc.wait(20))
        assert code == 0 and worker.proc.poll() is None  # the ps left; the worker stays
        await coordinator.close()
    finally:
        ps.stop()
        worker.stop()


@pytest.mark.timeout(180)  # 26 interpreters, about a second of imports each, on a loaded machine
def test_a_file_or_port_given_wrong_is_one_line_naming_the_flag(tmp_path):
    """An operator's typo is a one-line error naming the flag, exit status 2, no traceback."""
    missing = str(tmp_path / "missing")
    bad_pem = tmp_path / "bad.pem"
    bad_pem.write_text("not a certificate")
    cases = [
        (
            ("serve", "--role", "ps", "--port", "99999"),
            "argument --port: a port must be a whole number from 0 to 65535, got 99999",
        ),
        (("serve", "--role", "ps", "--port", "x"), "argument --port: 'x' is not a number"),
        (("serve", "--role", "ps", "--cpus", "one"), "argument --cpus: 'one' is not a list of cores"),
        (
            ("serve", "--role", "worker", "--keep-freed", "3GiB"),
            "argument --keep-freed: --keep-freed must be at most 2GiB, got 3221225472",
        ),
        (
            ("serve", "--role", "worker", "--keep-freed", "lots"),
            "argument --keep-freed: --keep-freed must be a size in bytes such as 512MiB, got 'lots'",
        ),
        (
            ("serve", "--role", "ps", "--cpus", f"{max(os.sched_getaffinity(0)) + 1}"),
            f"argument --cpus: cores [{max(os.sched_getaffinity(0)) + 1}] are not among those",
        ),
        (
            ("serve", "--role", "ps", "--cluster", missing),
            f"--cluster {missing}: the file cannot be read (No such file or directory)",
        ),
        (
            ("serve", "--role", "ps", "--port", "0", "--token-file", missing),
            f"--token-file {missing}: the file cannot be read",
        ),
        (
            ("status", "--cluster", str(tmp_path)),
            f"--cluster {tmp_path}: the file cannot be read (Is a directory)",
        ),
        (("status", "--cluster", missing, "--token-file", missing), f"--cluster {missing}"),
        (
            ("serve", "--role", "ps", "--port", "0", "--tls-cert", str(bad_pem), "--tls-key", str(bad_pem)),
            f"--tls-cert {bad_pem} / --tls-key {bad_pem}: cannot be loaded",
        ),
        (
            ("serve", "--role", "worker", "--port", "0", "--tls-ca", missing),
            f"--tls-ca {missing}: cannot be loaded",
        ),
        (
            (
                "serve",
                "--role",
                "ps",
                "--port",
                "0",
                "--memory-budget",
                "8MiB",
                "--table-dir",
                "/proc/pstrain-tier",
            ),
            "table_dir '/proc/pstrain-tier': this ps cannot keep its tables' rows there: "
            "No such file or directory",
        ),
        (
            ("serve", "--role", "ps", "--port", "0", "--max-body", "-1"),
            "argument --max-body: it must be a whole number of 1 or more, got -1",
        ),
        (
            ("serve", "--role", "worker", "--port", "0", "--closure-threads", "0"),
            "argument --closure-threads: it must be a whole number of 1 or more, got 0",
        ),
        (
            ("serve", "--role", "ps", "--index", "-1"),
            "argument --index: it must be a whole number of 0 or more, got -1",
        ),
        (("serve", "--role", "ps", "--port", "0", "--max-store-bytes", "0"), "--max-store-bytes"),
        (
            ("serve", "--role", "ps", "--port", "0", "--drain-timeout", "nan"),
            "argument --drain-timeout: a duration must be a finite number of seconds of 0 or more, got nan",
        ),
        (
            ("serve", "--role", "ps", "--port", "0", "--log-level", "LOUD"),
            "argument --log-level: 'LOUD' is not a log level",
        ),
        (
            ("serve", "--role", "ps", "--port", "0", "--advertise", "nocolon"),
            "argument --advertise: malformed address 'nocolon'",
        ),
        (
            ("status", "--timeout", "-1"),
            "argument --timeout: a duration must be a finite number of seconds of 0 or more, got -1.0",
        ),
        (
            ("launch", "--workers", "0", "--", "true"),
            "argument --workers: it must be a whole number of 1 or more, got 0",
        ),
        (
            ("launch", "--", missing),
            f"'{missing}': no such command (not on PATH, nor an executable file); nothing was started",
        ),
        (("demo", "--steps", "0"), "argument --steps: it must be a whole number of 1 or more, got 0"),
        (
            ("serve", "--role", "ps", "--port", "0", "--checkpoint-root", str(bad_pem)),
            f"argument --checkpoint-root: '{bad_pem}' is not a directory",
        ),
        (
            ("serve", "--role", "ps", "--port", "0", "--checkpoint-root", f"{bad_pem}/ckpts"),
            f"argument --checkpoint-root: '{bad_pem}/ckpts' cannot be a directory: {bad_pem} is a file",
        ),
    ]
    # each case a process of its own (about 0.7 s of imports each), three at a time
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda case: run_cli(*case[0]), cases))
    for (args, message), result in zip(cases, results, strict=True):
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
    result = run_cli(
        "serve",
        "--role",
        "ps",
        "--port",
        "0",
        env={**{k: v for k, v in os.environ.items() if k != "PSTRAIN_TOKEN"}, "PSTRAIN_TOKEN_FILE": missing},
    )
    assert (
        result.returncode == 2
        and f"PSTRAIN_TOKEN_FILE {missing}: the file cannot be read" in result.stderr
        and "Traceback" not in result.stderr
    ), result.stderr


def test_pstrain_config_may_name_a_file_and_a_path_in_tf_config_says_what_is_wrong(tmp_path):

    config = tmp_path / "cluster.json"
    config.write_text(
        json.dumps({"cluster": {"ps": ["h:1"], "worker": ["h:2"]}, "task": {"type": "worker", "index": 0}})
    )
    spec, task_type, index = parse_config(str(config), "PSTRAIN_CONFIG")
    assert spec.job_tasks("ps") == ["h:1"] and (task_type, index) == ("worker", 0)
    with pytest.raises(InvalidArgumentError, match="neither JSON nor a readable file"):
        parse_config(str(tmp_path / "missing.json"), "PSTRAIN_CONFIG")
    with pytest.raises(InvalidArgumentError, match="TF_CONFIG must hold the JSON itself"):
        parse_config(str(config), "TF_CONFIG")


def test_help_names_the_evaluator_and_status_explains_its_columns(capsys):

    for argv in (["--help"], ["status", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    out = capsys.readouterr().out
    assert "sidecar evaluator" in out
    assert "Columns:" in out and "refused (wrong token)" in out and "REQUESTS" in out


def test_launch_prefixes_every_line_the_servers_write():

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pstrain",
            "launch",
            "--ps",
            "1",
            "--workers",
            "1",
            "--log-level",
            "INFO",
            "--",
            sys.executable,
            "-c",
            "print('hello from the chief')",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "[chief] hello from the chief" in result.stdout
    server_lines = [ln for ln in result.stderr.splitlines() if "pstrain.server" in ln]
    assert server_lines and all(ln.startswith(("[ps:0] ", "[worker:0] ")) for ln in server_lines), (
        result.stderr
    )


def test_a_closure_that_cannot_reach_its_ps_is_told_what_to_do():

    assert (
        "restore" in ps_advice("/job:ps/replica:0/task:1") and ps_advice("/job:worker/replica:0/task:0") == ""
    )
