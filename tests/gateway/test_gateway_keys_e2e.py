"""`capstan gateway --client-keys` in front of a real replica that checks its own API key, used through the openai
client: 401 without a known key, 403 for a model the key may not use, 429 with Retry-After and x-ratelimit-* when
a budget is spent and success in the next window, exact per-client token metrics, a rotated key file taking effect
without a restart, budgets shared by two gateway replicas, and the replica's key never shown to anyone."""

from __future__ import annotations

import concurrent.futures
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from processes import metric, start_gateway, start_replica  # noqa: E402

pytestmark = pytest.mark.slow
REPLICA_KEY = "sk-replica-only-0f1e2d3c4b5a69788796a5b4"
WINDOW = 6.0  # seconds of a budget window in these tests; per-minute budgets scale by WINDOW / 60
KEYS = {name: f"sk-client-{name}-0123456789abcdef" for name in ("open", "small", "tokens", "other-model", "meter")}
LOAD_KEYS = {f"load{i}": f"sk-load-{i}-0123456789abcdef" for i in range(8)}


def clients_file(path: Path, keys: dict[str, str], **per_client) -> str:
    entries = [{"name": name, "key": key, "models": ["tiny"], **per_client.get(name, {})} for name, key in keys.items()]
    path.write_text(yaml.safe_dump({"clients": entries}))
    return str(path)


def fresh_window(window: float, need: float) -> None:
    """Sleep into a budget window (windows are aligned to the epoch) that has at least `need` seconds left."""
    if window - time.time() % window < need:
        time.sleep(window - time.time() % window + 0.05)


@pytest.fixture(scope="module")
def replica():
    r = start_replica("tiny", extra=["--api-key", REPLICA_KEY])
    try:
        yield r.wait_ready()
    finally:
        r.stop()


@pytest.fixture(scope="module")
def keyfiles(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    clients = clients_file(
        folder / "clients.yaml",
        KEYS,
        small={"requestsPerMinute": 20},  # 2 per window
        tokens={"tokensPerMinute": 300},  # 30 per window: a request's worst case is reserved at admission
        **{"other-model": {"models": ["not-tiny"]}},
    )
    upstream = folder / "upstream.yaml"
    upstream.write_text(yaml.safe_dump({"tiny": REPLICA_KEY}))
    return Path(clients), upstream


@pytest.fixture(scope="module")
def gateway(replica, keyfiles):
    clients, upstream = keyfiles
    g = start_gateway(
        [f"tiny={replica.url}"],
        "--client-keys",
        str(clients),
        "--upstream-keys",
        str(upstream),
        "--budget-window",
        str(WINDOW),
        "--poll-interval",
        "0.25",
        "--log-level",
        "debug",
    )
    try:
        yield g.wait_ready(30)
    finally:
        assert REPLICA_KEY not in g.output()  # not logged, even at debug
        g.stop()


def client_for(gateway, name: str | None, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{gateway.url}/v1",
        api_key=key or (KEYS.get(name, "none") if name else "none"),
        max_retries=0,
        timeout=120,
    )


def test_the_replica_checks_its_own_key(replica):
    assert httpx.post(f"{replica.url}/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401


def test_no_key_or_a_wrong_key_is_401(gateway):
    assert httpx.post(f"{gateway.url}/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401
    for key in ("sk-guessed-0123456789abcdef", REPLICA_KEY):  # the replica's own key is no client key
        with pytest.raises(openai.AuthenticationError) as error:
            client_for(gateway, None, key).completions.create(model="tiny", prompt="x", max_tokens=1)
        assert error.value.body["code"] == "invalid_api_key" and REPLICA_KEY not in error.value.response.text


def test_a_model_the_key_may_not_use_is_403(gateway):
    assert [m.id for m in client_for(gateway, "open").models.list().data] == ["tiny"]
    assert client_for(gateway, "other-model").models.list().data == []  # only the models a key may use
    with pytest.raises(openai.AuthenticationError):
        client_for(gateway, None, "sk-guessed-0123456789abcdef").models.list()
    with pytest.raises(openai.PermissionDeniedError) as error:
        client_for(gateway, "other-model").completions.create(model="tiny", prompt="x", max_tokens=1)
    assert error.value.body["code"] == "model_not_allowed" and error.value.body["param"] == "model"
    assert metric(gateway.url, "capstan_gateway_client_rejections_total", client="other-model", reason="model") == 1


def test_a_spent_request_budget_is_429_with_headers_then_recovers(gateway):
    small = client_for(gateway, "small")
    fresh_window(WINDOW, 4)
    for _ in range(2):
        ok = small.completions.with_raw_response.create(model="tiny", prompt="Hello", max_tokens=1)
        assert ok.headers["x-ratelimit-limit-requests"] == "2" and REPLICA_KEY not in ok.text
    with pytest.raises(openai.RateLimitError) as error:
        small.completions.create(model="tiny", prompt="Hello", max_tokens=1)
    headers = error.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= WINDOW + 1 and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s") and error.value.body["code"] == "rate_limit_exceeded"
    time.sleep(float(headers["x-ratelimit-reset-requests"][:-1]) + 0.1)
    assert small.completions.create(model="tiny", prompt="Hello", max_tokens=1).choices
    assert metric(gateway.url, "capstan_gateway_client_rejections_total", client="small", reason="requests") == 1


def test_a_spent_token_budget_is_429(gateway):
    tokens = client_for(gateway, "tokens")
    fresh_window(WINDOW, 4)
    first = tokens.completions.with_raw_response.create(model="tiny", prompt="Count the tokens", max_tokens=4)
    assert int(first.headers["x-ratelimit-remaining-tokens"]) < 30  # its worst case, held while it ran
    with pytest.raises(openai.RateLimitError) as error:  # its worst case does not fit what is left
        tokens.completions.create(model="tiny", prompt="x", max_tokens=29)
    assert error.value.response.headers["retry-after"] and error.value.body["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError) as error:  # nor would it in a whole window
        tokens.completions.create(model="tiny", prompt="x", max_tokens=40)
    assert "whole budget" in error.value.body["message"]


def test_usage_metrics_count_tokens_exactly(gateway):
    meter = client_for(gateway, "meter")
    prompt = "The capstan turns and the rope"
    whole = meter.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    chunks = list(meter.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True))
    assert all(getattr(c, "usage", None) is None for c in chunks)  # the usage chunk the gateway asked for is not shown
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    reported = list(
        meter.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = reported[-1].usage
    prompt_total = 2 * whole.usage.prompt_tokens + usage.prompt_tokens
    completion_total = 2 * whole.usage.completion_tokens + usage.completion_tokens
    assert metric(gateway.url, "capstan_gateway_client_tokens_total", client="meter", kind="prompt") == prompt_total
    assert (
        metric(gateway.url, "capstan_gateway_client_tokens_total", client="meter", kind="completion")
        == completion_total
    )
    assert metric(gateway.url, "capstan_gateway_client_requests_total", client="meter", code="200") == 3


def test_a_rotated_key_file_takes_effect_without_a_restart(gateway, keyfiles):
    clients, _ = keyfiles
    before = clients.read_text()
    rotated = "sk-client-open-rotated-0123456789"
    try:
        clients.write_text(before.replace(KEYS["open"], rotated))

        def old_refused():
            try:
                client_for(gateway, "open").completions.create(model="tiny", prompt="x", max_tokens=1)
                return False
            except openai.AuthenticationError:
                return True

        deadline = time.monotonic() + 15
        while not old_refused():
            assert time.monotonic() < deadline, "the rotated key file did not take effect within 15 s"
            time.sleep(0.5)
        assert client_for(gateway, None, rotated).completions.create(model="tiny", prompt="x", max_tokens=1).choices
    finally:
        clients.write_text(before)


def test_two_gateway_replicas_share_a_budget_and_never_exceed_it(replica, keyfiles, tmp_path):
    key = "sk-shared-0123456789abcdef"
    clients = clients_file(tmp_path / "shared.yaml", {"shared": key}, shared={"requestsPerMinute": 40})  # 4/window
    flags = [
        "--client-keys",
        clients,
        "--upstream-keys",
        str(keyfiles[1]),
        "--budget-window",
        str(WINDOW),
        "--budget-shares",
        "2",
    ]
    gateways = [start_gateway([f"tiny={replica.url}"], *flags) for _ in range(2)]
    try:
        for g in gateways:
            g.wait_ready(30)
        fresh_window(WINDOW, 4)
        admitted = 0
        for g in gateways:
            for _ in range(3):
                try:
                    client_for(g, None, key).completions.create(model="tiny", prompt="x", max_tokens=1)
                    admitted += 1
                except openai.RateLimitError:
                    pass
        assert admitted == 4  # 2 each: the budget, and not more
    finally:
        for g in gateways:
            g.stop()


def test_load_only_the_key_over_budget_is_refused(replica, keyfiles, tmp_path):
    """64 streams across 8 keys at once; load7 may make 2 requests a window, the others are unlimited."""
    clients = clients_file(tmp_path / "load.yaml", LOAD_KEYS, load7={"requestsPerMinute": 2})
    g = start_gateway([f"tiny={replica.url}"], "--client-keys", clients, "--upstream-keys", str(keyfiles[1]))
    try:
        g.wait_ready(30)
        fresh_window(60, 40)

        def stream(name: str) -> str:
            try:
                chunks = list(
                    client_for(g, None, LOAD_KEYS[name]).completions.create(
                        model="tiny", prompt=f"Stream for {name}", max_tokens=4, stream=True
                    )
                )
                return "ok" if chunks[-1].choices[0].finish_reason else "incomplete"
            except openai.RateLimitError:
                return "429"

        names = [name for name in LOAD_KEYS for _ in range(8)]
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            outcomes = list(pool.map(stream, names))
        by_key = {name: [o for n, o in zip(names, outcomes, strict=True) if n == name] for name in LOAD_KEYS}
        assert by_key.pop("load7").count("ok") == 2 and outcomes.count("429") == 6
        assert all(o == ["ok"] * 8 for o in by_key.values()), by_key
        assert metric(g.url, "capstan_gateway_client_rejections_total", client="load7", reason="requests") == 6
    finally:
        g.stop()
