"""`capstan serve --kv-cache-dtype fp8`: the server stores K/V pages as FP8 and answers the openai client; a bad
value is a CLI error naming the flag, before anything loads."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from servers import MODEL, ServeProcess

pytestmark = pytest.mark.slow


def test_serve_with_fp8_pages_answers_the_openai_client():
    with ServeProcess("--kv-cache-dtype=fp8") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)
        done = client.completions.create(model=MODEL, prompt="hello there", max_tokens=8, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens == 8
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        logged = "".join(server.output)
        assert "float8_e4m3fn" in logged, logged[-3000:]  # the engine's "KV cache: N pages ..." line


def test_a_bad_kv_cache_dtype_is_a_cli_error_naming_the_flag():
    out = subprocess.run(
        [sys.executable, "-m", "capstan.runtime.cli", "serve", "--kv-cache-dtype", "fp8_e5m2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--kv-cache-dtype: invalid choice: 'fp8_e5m2'" in out.stderr and "Traceback" not in out.stderr
