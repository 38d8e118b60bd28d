"""The `grammar` request field: a music model served over HTTP samples only the events its representation's grammar
allows next (valid music by construction, txl_deploy/music/grammar.py), seeded requests repeat, and an unknown
grammar, or one the vocabulary cannot follow, is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from conftest import start_server
from helpers.event_models import REMI_SYMBOLS, save_event_model

from txl_deploy.music.grammar import compiled


@pytest.fixture(scope="module")
def remi_server(tmp_path_factory):
    srv = start_server(save_event_model(tmp_path_factory.mktemp("remi") / "remi", "remi"), max_batch=4)
    yield srv
    srv.stop()


def _complete(srv, **body):
    return httpx.post(srv.url + "/v1/completions", json={"prompt": [0], "return_token_ids": True, **body},
                      timeout=60)


def test_a_grammar_request_samples_only_what_the_grammar_allows(remi_server):
    g = compiled("remi", REMI_SYMBOLS)
    r = _complete(remi_server, max_tokens=120, temperature=1.2, seed=4, grammar="remi")
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert len(ids) == 120 and g.first_error([0] + ids) is None
    again = _complete(remi_server, max_tokens=120, temperature=1.2, seed=4, grammar="remi")
    assert again.json()["choices"][0]["token_ids"] == ids
    free = _complete(remi_server, max_tokens=120, temperature=1.2, seed=4)
    assert g.first_error([0] + free.json()["choices"][0]["token_ids"]) is not None


@pytest.mark.parametrize("grammar, message", [
    ("midi", "unknown grammar 'midi'"),
    ("remi-xl", "needs a vocabulary of remi-xl events; this one's symbols are remi events")])
def test_a_grammar_the_server_cannot_apply_is_a_400(remi_server, grammar, message):
    r = _complete(remi_server, max_tokens=4, grammar=grammar)
    assert r.status_code == 400
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == "grammar" and "\n" not in error["message"]


def test_a_session_goes_on_with_its_piece_across_requests_and_forks(remi_server):
    """A song added a request at a time: a session's request under the grammar continues the state its last one
    left (here in the middle of a note, so only its pitch may follow), and so does a fork; a request without the
    grammar ends the piece, and the next one starts after its own prompt."""
    g = compiled("remi", REMI_SYMBOLS)
    opened = [REMI_SYMBOLS.index(e) for e in ("Bar_None", "Position_5/16", "Note Velocity_12")]
    sid = "song-grammar"
    assert httpx.post(remi_server.url + "/v1/sessions", json={"id": sid}).status_code == 201
    first = _complete(remi_server, prompt=opened, max_tokens=1, seed=1, grammar="remi", session_id=sid)
    assert first.status_code == 200, first.text
    song = opened + first.json()["choices"][0]["token_ids"]
    assert REMI_SYMBOLS[song[-1]].startswith("Note On_")
    r = httpx.post(remi_server.url + f"/v1/sessions/{sid}/fork", json={"id": sid + "-fork"})
    assert r.status_code in (200, 201), r.text
    for session in (sid, sid + "-fork"):
        more = _complete(remi_server, prompt=[], max_tokens=30, temperature=1.2, seed=2, grammar="remi",
                         session_id=session).json()["choices"][0]["token_ids"]
        assert REMI_SYMBOLS[more[0]].startswith("Note Duration_")
        assert g.first_error(song + more) is None
    _complete(remi_server, prompt=[], max_tokens=2, seed=3, session_id=sid)  # without the grammar
    after = _complete(remi_server, prompt=[], max_tokens=1, seed=4, grammar="remi", session_id=sid)
    assert REMI_SYMBOLS[after.json()["choices"][0]["token_ids"][0]] == "Bar_None"  # a new piece opens with a bar
