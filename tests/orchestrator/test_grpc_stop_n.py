"""gRPC honours stop strings (the router cuts the text, as for HTTP) and ``n`` (choices
multiplexed on one stream, each with its index and seed ``seed + i``), over fake leaders."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.router.output_text import OutputText
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import TOKENIZER, Harness
from tests.orchestrator.test_router import _calls, _client_id, _wait_for
from tests.orchestrator.test_router_abort import _nothing_left

PROMPT = "stop strings over gRPC"
MAX_TOKENS = 40


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.close()


def _full() -> tuple[list[int], str]:
    toks = expected_tokens(tuple(TOKENIZER.encode(PROMPT)), MAX_TOKENS)
    return toks, TOKENIZER.decode(toks)


def _run(h, **kwargs):
    with OrchClient(h.address) as client:
        chunks = list(client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs))
    return "".join(c.text for c in chunks), chunks


def _split_stop(toks: list[int], full: str) -> str:
    """A stop string whose first match starts in one token's text and ends in a later one's."""
    for k in range(3, len(toks) - 3):
        b = len(TOKENIZER.decode(toks[:k]))
        if not full.startswith(TOKENIZER.decode(toks[:k])) or b < 2:
            continue
        stop = full[b - 2:b + 2]
        if (len(stop) == 4 and full.find(stop) == b - 2
                and len(TOKENIZER.decode(toks[k:k + 1])) >= 2):
            return stop
    raise AssertionError("no token boundary to split a stop string across")


def test_stop_string_split_across_tokens_cuts_the_text_and_ends_the_request(h):
    toks, full = _full()
    stop = _split_stop(toks, full)
    text, chunks = _run(h, stop=[stop, "never-there"])
    assert text == full[:full.find(stop)]
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert _nothing_left(h)
    assert h.metrics.finished[-1][0] == "stop"


def test_output_text_finds_a_stop_string_fed_one_token_at_a_time():
    toks, full = _full()
    stop = _split_stop(toks, full)
    out, sent = OutputText(TOKENIZER, (stop,)), ""
    for i, tok in enumerate(toks):
        text, stopped = out.add((tok,))
        sent += text
        if stopped:
            break
    assert stopped and sent == full[:full.find(stop)]
    # NOTE: it ends on the token that completes the stop string, not before
    assert stop not in TOKENIZER.decode(toks[:i]) and stop in TOKENIZER.decode(toks[:i + 1])


def test_a_stop_string_inside_a_multi_token_event_cuts_the_ids_there(h):
    """The fake decode sends two tokens per event (as MTP's accepted drafts do): a stop string
    completed by an event's first token ends the ids (and the count) at that token, as one
    token per event would."""
    toks, full = _full()
    for i in range(3, len(toks) - 2, 2):  # NOTE: toks[i], i odd, opens a decode event
        upto = TOKENIZER.decode(toks[:i + 1])
        stop = upto[-3:]
        if (full.startswith(upto) and len(stop) == 3 and stop not in TOKENIZER.decode(toks[:i])
                and full.find(stop) == len(upto) - 3):
            break
    else:
        raise AssertionError("no token that both opens an event and completes a stop string")
    text, chunks = _run(h, stop=[stop])
    assert text == full[:full.find(stop)]
    assert [t for c in chunks for t in c.token_ids] == toks[:i + 1]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stats.completion_tokens == i + 1
    assert _nothing_left(h)


def test_stop_string_in_the_first_token_ends_the_request_on_its_instances(h):
    toks, full = _full()
    first = TOKENIZER.decode(toks[:1])
    assert first and full.startswith(first)
    # NOTE: decode never streams: only the router's stop can end the request
    _, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("admit"))
    text, chunks = _run(h, stop=[first[:1]])
    assert text == ""
    assert chunks[-1].finish_reason == "stop"
    assert [t for c in chunks for t in c.token_ids] == toks[:1]
    assert _wait_for(lambda: any(c[0] == "abort" for c in _calls(h, "decode-0")))
    h.call_in_loop(release.set)
    assert _nothing_left(h)
    assert h.metrics.finished[-1][0] == "stop"


def test_stop_string_not_present_changes_nothing(h):
    toks, full = _full()
    text, chunks = _run(h, stop=["\x00never-there\x00"])
    assert text == full
    assert [t for c in chunks for t in c.token_ids] == toks
    assert chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("stop, words", [
    ([""], "stop[0] is empty"),
    (["x"] * 17, "stop has 17 strings; at most 16"),
])
def test_bad_stop_strings_are_invalid_argument(h, stop, words):
    with pytest.raises(grpc.RpcError) as err:
        _run(h, stop=stop)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()


def test_n_choices_share_one_stream_with_their_index_and_seed(h):
    toks, full = _full()
    text, chunks = _run(h, n=3, seed=11, temperature=0.7, request_id="many")
    by_index = {i: [c for c in chunks if c.index == i] for i in range(3)}
    assert {c.index for c in chunks} == {0, 1, 2}
    for i, mine in by_index.items():
        assert [t for c in mine for t in c.token_ids] == toks
        assert "".join(c.text for c in mine) == full
        assert [c.finish_reason for c in mine][-1] == "length"
        assert all(c.finish_reason is None for c in mine[:-1])
        assert mine[-1].stats.completion_tokens == MAX_TOKENS
        assert {c.request_id for c in mine} == {f"many:{i}"}
    specs = h.call_in_loop(lambda: dict(h.fakes["prefill-0"].specs))
    seeds = {_client_id(a): s.sampling for a, s in specs.items()}
    assert {rid: p.seed for rid, p in seeds.items()} == {"many:0": 11, "many:1": 12,
                                                          "many:2": 13}
    # NOTE: choice i is the single request seeded seed + i
    _run(h, seed=12, temperature=0.7, request_id="single")
    specs = h.call_in_loop(lambda: dict(h.fakes["prefill-0"].specs))
    single = next(s.sampling for a, s in specs.items() if _client_id(a) == "single")
    assert single == seeds["many:1"]
    assert _nothing_left(h)


def test_n_with_a_stop_string_stops_every_choice(h):
    toks, full = _full()
    stop = _split_stop(toks, full)
    _, chunks = _run(h, n=2, stop=[stop])
    for i in range(2):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == full[:full.find(stop)]
        assert mine[-1].finish_reason == "stop"
    assert _nothing_left(h)


def test_n_over_16_is_invalid_argument(h):
    with pytest.raises(grpc.RpcError) as err:
        _run(h, n=17)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n is 17" in err.value.details()
