"""`capstan serve --ssl-keyfile/--ssl-certfile` with two frontends: the openai client trusting the test CA gets
answers from either, one trusting another CA is refused, and a renewed certificate is served without a restart.
(The certificate's reloading itself: tests/gateway/test_gateway_tls.py.)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import openai
import pytest
from servers import MODEL, ServeProcess

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
from test_gateway_tls import client_trusting, issue, make_ca  # noqa: E402

from capstan.runtime.server.tls import RELOAD_SECONDS  # noqa: E402

pytestmark = pytest.mark.slow


def answer(url: str, ca_file: Path) -> str:
    client = client_trusting(url, ca_file)
    return client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0).choices[0].text


def test_serve_over_tls_from_two_frontends(tmp_path):
    first, second = make_ca(tmp_path, "ca-one"), make_ca(tmp_path, "ca-two")
    keyfile, certfile = tmp_path / "tls.key", tmp_path / "tls.crt"
    issue(first, keyfile, certfile)
    server = ServeProcess("--api-server-count=2", "--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile))
    url = server.url.replace("http://", "https://")
    try:
        deadline = time.monotonic() + 300
        while True:  # ServeProcess waits in plain HTTP: wait through the openai client instead
            try:
                assert answer(url, first[2])
                break
            except (openai.APIConnectionError, openai.InternalServerError):  # not listening, or still compiling
                assert server.process.poll() is None and time.monotonic() < deadline, "".join(server.output)[-3000:]
                time.sleep(0.5)
        texts = {answer(url, first[2]) for _ in range(8)}  # new connections: both frontends answer
        assert len(texts) == 1, texts
        with pytest.raises(openai.APIConnectionError):
            answer(url, second[2])
        assert "https://127.0.0.1" in "".join(server.output)

        issue(second, keyfile, certfile)  # renewed in place, as cert-manager rewrites a mounted Secret
        deadline = time.monotonic() + RELOAD_SECONDS * 3 + 10
        for _ in range(8):  # every frontend reloads: each new connection may land on either
            while True:
                try:
                    assert answer(url, second[2]) in texts
                    break
                except openai.APIConnectionError:
                    assert time.monotonic() < deadline, "the renewed certificate was not served"
                    time.sleep(0.5)
        assert server.process.poll() is None
    finally:
        server.__exit__(None, None, None)
