"""A stand-in for `python -m sglang.launch_server` in tests of process handling (no SGLang needed).

Run as `fake -m sglang.launch_server --port P ...` (the shell wrapper the tests write passes the
arguments on): starts a child that sleeps (as SGLang's scheduler, in the same process group),
prints both PIDs to the log, and answers GET /health (200) and GET /server_info (SGLang's
version) on --host:--port. With
`--base-gpu-id 1` among the arguments it exits with code 3 at once (a server that cannot start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"version": "0.5.23"}).encode() if self.path == "/server_info" else b""
        self.send_response(200 if self.path in ("/health", "/server_info") else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # http.server's signature
        pass


def main(argv: list[str]) -> int:
    if "--base-gpu-id" in argv and argv[argv.index("--base-gpu-id") + 1] == "1":
        print("fake server: refusing to start", flush=True)
        return 3
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    child = subprocess.Popen(["sleep", "600"])
    print(f"server pid {os.getpid()} scheduler pid {child.pid}", flush=True)
    HTTPServer((host, port), Health).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
