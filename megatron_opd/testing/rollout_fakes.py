"""A stand-in for a vLLM rollout server (``rollout.address``), for tests of the server group without vLLM.

``FakeRolloutServer`` answers the routes :class:`megatron_opd.rollout.vllm_server.ServerClient` reads (world size,
weight version, model name, completions) from a thread; ``mode`` makes its completions slow (``delay_s``) or
drop the connection without a reply, as a server killed mid-request does.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeRolloutServer:
    """Routes of one vLLM rollout server; every completion is ``[7, 8]`` after ``delay_s`` (sooner once stopped, so a
    client's pending request does not hold its process), or a dropped connection (``mode="drop"``)."""

    def __init__(self, mode: str = "ok", delay_s: float = 0.0, version: str = "3") -> None:
        fake = self
        self.mode, self.delay_s, self.version = mode, delay_s, version
        self._stopping = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.startswith("/get_world_size"):
                    return self._reply({"world_size": 1})
                if self.path == "/weight_info":
                    return self._reply({"weight_version": fake.version})
                self._reply({"data": [{"id": "toy"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                if fake.mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                fake._stopping.wait(fake.delay_s)
                logprobs = {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -0.25]}
                self._reply({"choices": [{"logprobs": logprobs, "finish_reason": "length"}]})

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.address = f"127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        self._http.shutdown()
        self._http.server_close()
