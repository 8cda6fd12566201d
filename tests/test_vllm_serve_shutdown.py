"""An operator's shutdown of a two-node ``vllm serve``: vLLM's CPU build,
``--tensor-parallel-size 2 --nnodes 2`` (one worker per node), the OpenAI
API server on node 0 and ``--headless`` node 1, six completions over HTTP,
then SIGTERM to the API server.  Run on fastmq and on vLLM's own queue.

Each node runs in a mount namespace of its own with a fresh tmpfs on
``/dev/shm`` and a ``TMPDIR`` of its own; they talk over 127.0.0.1.  Each
node's shell runs ``_serve_children.py serve`` (``vllm serve ...``), then
``inspect``, which waits for every process of that node (the serve process
and all it started, listed by this test while the server was up) to exit
and lists, at once, fastmq's files there and the processes anywhere that
still hold or map a segment made by one of them.

Node 1 should end by itself once the engine is gone; if it has not after
``NODE1_GRACE`` seconds it is stopped with SIGTERM (recorded as
``stopped``).  Shmem is measured before the nodes start and after both
are gone.  The logs of the fastmq run may show no kind of error (error log
line by place, traceback by exception, EngineDeadError) that vLLM's own
queue's run of the same shutdown does not show on that node.  Both runs are
made once per module and several tests read them.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

import _nodes
from _held import shmem_bytes
from test_vllm_generation import ROOT, SHMEM_SLACK, TESTS, UNSET, _python, _unshare_ok

CHILD = os.path.join(TESTS, "_serve_children.py")
SCRIPT = ('mount -t tmpfs -o size=1g tmpfs /dev/shm || exit 97; c="$1"; f="$2"; shift 2; '
          '"$0" "$c" serve "$@"; printf "\\nSERVE_EXIT %s\\n" "$?"; '
          '"$0" "$c" inspect --pids "$f"')
READY_TIMEOUT = 240      # engine start on both nodes, on a loaded 2-core machine
REQUEST_TIMEOUT = 120
NODE0_EXIT_TIMEOUT = 150  # SIGTERM to the last LEFT line of node 0 (its inspect waits 120 s)
NODE1_GRACE = 60         # node 1 ending by itself once node 0's engine is gone
NODE1_EXIT_TIMEOUT = 150
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [10, 20, 30], [100, 200, 300, 400, 500], [7] * 12,
           [42], [3, 1, 4, 1, 5, 9, 2, 6]]
MAX_TOKENS = 8


def _serve_args(model: str, rank: int, master_port: int, http_port: int) -> list[str]:
    """``vllm serve`` arguments of node ``rank``: the engine arguments the
    other vLLM tests use, TP=2 over two nodes."""
    from _vllm_models import ENGINE_ARGS

    args = [model, "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    for key, value in ENGINE_ARGS.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    if rank == 0:
        args += ["--host", "127.0.0.1", "--port", str(http_port)]
    else:
        args += ["--headless"]
    return args


class _Node:
    """One node: its namespace running ``serve`` then ``inspect``, its
    output lines, the pids it ran."""

    def __init__(self, tmp_path, rank: int, py: str, env: dict, args: list[str]):
        self.rank = rank
        self.pids_file = tmp_path / f"node{rank}-pids.json"
        tmp = tmp_path / f"node{rank}-tmp"
        tmp.mkdir()
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", SCRIPT, py, CHILD,
             str(self.pids_file), *args],
            cwd=str(tmp_path), env=dict(env, TMPDIR=str(tmp)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.pids: list[int] = []
        # A reader thread: a process that outlives the shell (none should)
        # keeps the pipe open, and must not hang the test.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def value(self, key: str):
        got = [ln for ln in list(self.lines) if ln.startswith(key + " ")]
        return json.loads(got[-1].removeprefix(key + " ")) if got else None

    @property
    def serve_pid(self) -> int | None:
        return self.value("SERVE_PID")

    def list_pids(self) -> list[int]:
        """The serve process and everything it started, for ``inspect``."""
        root = psutil.Process(self.serve_pid)
        self.pids = sorted({root.pid, *(p.pid for p in root.children(recursive=True))})
        self.pids_file.write_text(json.dumps(self.pids))
        return self.pids

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        """Everything of this node: its process group, and any process it
        ran that left the group."""
        pids = set(self.pids)
        if self.serve_pid is not None:     # a node that failed before they were listed
            try:
                root = psutil.Process(self.serve_pid)
                pids |= {root.pid, *(p.pid for p in root.children(recursive=True))}
            except psutil.Error:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._reader.join(30)


def _wait_ready(port: int, nodes: dict) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        for rank, node in nodes.items():
            if node.proc.poll() is not None:
                raise AssertionError(f"node {rank} ended before the server was up:\n"
                                     + node.output()[-8000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise AssertionError("the API server was not up in time:\n" + nodes[0].output()[-8000:])


def _complete(port: int, model: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
            return {"status": r.status, "body": json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode(errors="replace")}
    except Exception as e:     # a timeout, a refused connection: the test reports it
        return {"status": None, "body": repr(e)}


def _six_completions(port: int, model: str) -> list[dict]:
    """The six prompts at once, as six clients would send them."""
    out: list = [None] * len(PROMPTS)

    def one(i):
        out[i] = _complete(port, model, PROMPTS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT + 30)
    return out


def serve_and_stop(tmp_path, fastmq_vllm: str) -> dict:
    """Both nodes up, six completions, SIGTERM to the API server, node 1
    left to end (stopped after ``NODE1_GRACE``); each node's LEFT, the
    completions, Shmem before and after, and the output of each node."""
    _unshare_ok()
    py = _python()
    model = tmp_path / "model"
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(PYTHONPATH=os.pathsep.join([TESTS, ROOT]), VLLM_HOST_IP="127.0.0.1",
               GLOO_SOCKET_IFNAME="lo", VLLM_CONFIGURE_LOGGING="1",
               VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1", FASTMQ_VLLM=fastmq_vllm)
    env.pop("FASTMQ_HOST_IP", None)
    subprocess.run([py, "-c", "import sys; import _vllm_models as g; "
                    "g.tiny_llama(sys.argv[1])", str(model)], env=env, check=True,
                   capture_output=True)
    master, http = _nodes.free_port(), _nodes.free_port()
    out: dict = {"stopped": False}
    shmem_before = shmem_bytes()
    started = time.monotonic()
    nodes: dict[int, _Node] = {}
    try:
        for rank in (1, 0):
            nodes[rank] = _Node(tmp_path, rank, py, env,
                                _serve_args(str(model), rank, master, http))
        _wait_ready(http, nodes)
        for node in nodes.values():
            node.list_pids()
        out["completions"] = _six_completions(http, str(model))
        os.kill(nodes[0].serve_pid, signal.SIGTERM)        # the operator stops the server
        out["sigterm_at"] = time.monotonic() - started
        try:
            nodes[0].proc.wait(NODE0_EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + NODE1_GRACE
        front1 = nodes[1].serve_pid
        while time.monotonic() < deadline and nodes[1].value("SERVE_EXIT") is None:
            time.sleep(0.2)
        if nodes[1].value("SERVE_EXIT") is None:
            out["stopped"] = True                          # ... and then node 1
            try:
                os.kill(front1, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            nodes[1].proc.wait(NODE1_EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
    finally:
        for node in nodes.values():
            node.kill()
    out["seconds"] = time.monotonic() - started
    print(f"\n[serve shutdown, FASTMQ_VLLM={fastmq_vllm}] {out['seconds']:.0f} s; node 1 "
          f"{'stopped with SIGTERM' if out['stopped'] else 'ended by itself'}", flush=True)
    out["shmem_before"], out["shmem_after"] = shmem_before, shmem_bytes()
    for rank, node in nodes.items():
        out[f"output{rank}"] = node.output()
        (tmp_path / f"node{rank}.log").write_text(node.output())   # for a post-mortem
    (tmp_path / "completions.json").write_text(json.dumps(out.get("completions"), indent=1))
    for rank, node in nodes.items():
        tail = node.output()[-12000:]
        assert node.proc.returncode == 0, f"node {rank}:\n{tail}"
        for key in ("SERVE_EXIT", "LEFT"):
            assert node.value(key) is not None, f"node {rank}: no {key} line:\n{tail}"
        out[f"left{rank}"] = node.value("LEFT")
        out[f"serve_exit{rank}"] = node.value("SERVE_EXIT")
    return out


@pytest.fixture(scope="module")
def fastmq_run(tmp_path_factory):
    return serve_and_stop(tmp_path_factory.mktemp("fastmq"), "1")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    return serve_and_stop(tmp_path_factory.mktemp("vllm"), "0")


# A line of a process vLLM started may carry "(EngineCore pid=123) ";
# vLLM's (and fastmq's) log lines: "ERROR 05-12 06:10:13 [core.py:123] ...";
# uvicorn's: "ERROR:    ...".
_PREFIX = re.compile(r"^\([^()]* pid=\d+\) ?")
_LOG = re.compile(r"^(?P<level>[A-Z]+) \d\d-\d\d [\d:.]+ \[(?P<where>[^\]]+)\] ?")
_UVICORN = re.compile(r"^(?P<level>ERROR|CRITICAL):\s+(?P<msg>.*)")
_EXC = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)(?::|$)")


def _messages(output: str) -> list[tuple[str, str | None, str]]:
    """Each line as (its process prefix; its log level and place, or None;
    its message)."""
    out = []
    for line in output.splitlines():
        line = line.rstrip()
        p = _PREFIX.match(line)
        prefix, line = (p[0], line[p.end():]) if p else ("", line)
        m = _LOG.match(line)
        where = f"{m['level']} [{m['where']}]" if m else None
        out.append((prefix, where, line[m.end():] if m else line))
    return out


def _vllms_shutdown_race(msgs) -> set[int]:
    """The lines of vLLM's own shutdown noise: once the API server is told
    to stop, it stops the engine client with no grace (the engine core is
    SIGKILLed at once), and its output handler, if it is still waiting on
    the engine core's socket then, logs "AsyncLLM output_handler failed."
    with an EngineDeadError.  It comes and goes with vLLM's own queue too
    (about one run in five here); any other EngineDeadError counts."""
    out = set()
    stopping = False
    for i, (prefix, where, msg) in enumerate(msgs):
        stopping = stopping or "[shutdown] API server: shutdown triggered" in msg
        if not (stopping and where and msg == "AsyncLLM output_handler failed."):
            continue
        record = [i]            # the record's lines: same process, same place
        while record[-1] + 1 < len(msgs) and msgs[record[-1] + 1][:2] == (prefix, where):
            record.append(record[-1] + 1)
        if msgs[record[-1]][2].startswith("vllm.v1.engine.exceptions.EngineDeadError"):
            out.update(record)
    return out


def error_markers(output: str) -> set[str]:
    """The kinds of error one node's output shows: ``ERROR [file:line]`` per
    error log line (CRITICAL too; uvicorn's by their first words),
    ``Traceback -> <exception>`` per traceback, logged or printed (the
    exception it ends with), ``EngineDeadError`` wherever it is named;
    vLLM's own shutdown race (``_vllms_shutdown_race``) left out.
    Messages (pids, ports, counts) are left out: the same kind of error in
    both runs is the same marker."""
    out = set()
    msgs = _messages(output)
    skip = _vllms_shutdown_race(msgs)
    for i, (_, where, msg) in enumerate(msgs):
        if i in skip:
            continue
        if where and where.split()[0] in ("ERROR", "CRITICAL"):
            out.add(where)
        u = _UVICORN.match(msg) if where is None else None
        if u:
            out.add(f"{u['level']}: " + re.sub(r"\d+", "N", u["msg"])[:40])
        if "EngineDeadError" in msg:
            out.add("EngineDeadError")
        if msg.startswith("Traceback (most recent call last)"):
            end = "?"
            for _, _, nxt in msgs[i + 1:i + 400]:
                if nxt.startswith((" ", "\t", "Traceback")) or not nxt.strip():
                    continue
                e = _EXC.match(nxt)
                end = e["name"] if e else nxt[:40]
                break
            out.add(f"Traceback -> {end}")
    return out


def run_markers(run: dict) -> set[str]:
    return {f"node {rank}: {m}" for rank in (0, 1) for m in error_markers(run[f"output{rank}"])}


def test_the_completions_are_answered(fastmq_run, vllm_run):
    for run in (fastmq_run, vllm_run):
        for got in run["completions"]:
            assert got["status"] == 200, got
            choice = got["body"]["choices"][0]
            assert len(choice["token_ids"]) == MAX_TOKENS, got
            assert got["body"]["usage"]["completion_tokens"] == MAX_TOKENS, got
    # Greedy sampling on the same (dummy, seeded) weights: the same tokens.
    assert [c["body"]["choices"][0]["token_ids"] for c in fastmq_run["completions"]] == \
        [c["body"]["choices"][0]["token_ids"] for c in vllm_run["completions"]]


def test_fastmq_is_active_on_both_nodes(fastmq_run, vllm_run):
    from test_vllm_multinode import active_pids

    for rank in (0, 1):
        assert active_pids(fastmq_run[f"output{rank}"]), fastmq_run[f"output{rank}"][-8000:]
    assert not active_pids(vllm_run["output0"] + vllm_run["output1"])


def test_the_api_server_exits_on_sigterm(fastmq_run, vllm_run):
    for run in (fastmq_run, vllm_run):
        assert run["serve_exit0"] == 0, run["output0"][-8000:]


def test_the_headless_node_ends_by_itself(fastmq_run):
    assert not fastmq_run["stopped"], fastmq_run["output1"][-8000:]
    assert fastmq_run["serve_exit1"] == 0, fastmq_run["output1"][-8000:]


@pytest.mark.parametrize("rank", [0, 1])
def test_nothing_left_on_either_node(fastmq_run, rank):
    left = fastmq_run[f"left{rank}"]
    tail = fastmq_run[f"output{rank}"][-4000:]
    assert left["pids"], (left, tail)
    assert not left["still_running"], (left, tail)
    assert left["left"] == [], (left, tail)
    assert left["held"] == {}, (left, tail)


def test_shared_memory_is_back(fastmq_run):
    """Shmem once both nodes are gone (their private /dev/shm with them):
    no segment of the run's outlives it."""
    grown = fastmq_run["shmem_after"] - fastmq_run["shmem_before"]
    assert grown < SHMEM_SLACK, (f"Shmem grew by {grown >> 20} MiB", fastmq_run["left0"],
                                 fastmq_run["left1"])


def test_no_error_that_vllms_own_queue_does_not_log(fastmq_run, vllm_run):
    extra = run_markers(fastmq_run) - run_markers(vllm_run)
    assert not extra, (sorted(extra), fastmq_run["output0"][-6000:],
                       fastmq_run["output1"][-6000:])
