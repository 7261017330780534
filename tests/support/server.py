"""A vLLM OpenAI server in a subprocess, for the tests that talk to it over HTTP.

:func:`served` starts ``argv`` (a server command line), waits for ``/health`` and yields a
:class:`Server`; on exit it terminates the process. The log goes to ``log_path``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

#: The checkout's root.
ROOT_DIR = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**extra: str) -> dict[str, str]:
    """The environment for a CPU server: 1 GiB of KV cache, no tokenizer threads."""
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", **extra})
    return env


@dataclass
class Server:
    """A running server: ``base`` URL, the process and its log file."""

    base: str
    process: subprocess.Popen
    log_path: Path

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        """``(status, body)`` of ``GET base + path`` (an HTTP error status is returned too)."""
        try:
            with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body: dict[str, Any], timeout: float = 300.0
             ) -> tuple[int, dict[str, Any]]:
        """``(status, JSON body)`` of ``POST base + path`` with ``body`` as JSON."""
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def served(argv: list[str], port: int, log_path: Path, *, env: dict[str, str] | None = None,
           cwd: Path | None = None, start_timeout: float = 300.0) -> Iterator[Server]:
    """Run ``argv`` (which must listen on ``port``) until ``/health`` answers 200, yield it.

    Raises:
        RuntimeError: the process exited, or was not healthy within ``start_timeout`` seconds
            (the message ends with the log's tail).
    """
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, env=env or server_env(), stdout=log, stderr=subprocess.STDOUT,
                            cwd=cwd)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.time() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError("server exited:\n" + server.log()[-4000:])
            try:
                if server.get("/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not healthy in {start_timeout} s:\n"
                                   + server.log()[-4000:])
            time.sleep(1.0)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
