"""What the gateway keeps of a replica's /v1/models (its cards by id, adapters with their parent) and how it reads
a replica's OpenAI error body."""

from capstan.runtime.gateway.discovery import StaticDiscovery
from capstan.runtime.gateway.proxy import _error_code
from capstan.runtime.gateway.replica_pool import Replica, ReplicaPool, model_cards


def test_cards_by_id_skip_what_is_not_a_card():
    listing = {
        "data": [
            {"id": "tiny", "object": "model", "parent": None},
            {"id": "sql", "object": "model", "root": "/a/sql", "parent": "tiny"},
            {"id": ""},
            "junk",
            {"object": "model"},
        ]
    }
    assert list(model_cards(listing)) == ["tiny", "sql"]
    assert model_cards(["not", "a", "listing"]) == {} and model_cards({"data": None}) == {}


def test_a_replica_that_answered_model_not_found_is_not_chosen_for_that_model():
    pool = ReplicaPool(StaticDiscovery([]))
    replica = pool.replicas.setdefault("http://r:1", Replica("http://r:1", "tiny", ready=True))
    replica.cards = model_cards({"data": [{"id": "tiny"}, {"id": "sql", "parent": "tiny"}]})
    replica.served_models = tuple(replica.cards)
    assert pool.ready_for("sql") == [replica] and pool.card("sql")["parent"] == "tiny"
    replica.forget("sql")
    assert pool.ready_for("sql") == [] and not pool.serves("sql") and pool.card("sql") is None
    assert pool.ready_for("tiny") == [replica]


def test_error_codes_of_openai_bodies():
    assert _error_code(b'{"error": {"message": "x", "code": "model_not_found"}}') == "model_not_found"
    assert _error_code(b"not json") is None and _error_code(b"[1]") is None and _error_code(b'{"error": "x"}') is None
