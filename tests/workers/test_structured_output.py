"""Grammar-constrained output through a real rank (the tiny random model: its text is noise,
so only the grammar makes the output valid): 50 sampled requests per JSON schema, batched,
all parse and validate (jsonschema), colocated and prefill -> decode (the grammar state goes
with the tokens); regex outputs all match; a request without a grammar in the same batch gets
the tokens it gets alone."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from engine.request import RequestSpec
from engine.sampling_params import GrammarSpec, SamplingParams
from orchestrator.router.detokenizer import Tokenizer
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Generate
from rank.rank import Rank

N = 50
MAX_TOKENS = 96
SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"],
               "properties": {"user": {
                   "type": "object", "additionalProperties": False, "required": ["name", "id"],
                   "properties": {"name": {"type": "string", "maxLength": 6},
                                  "id": {"type": "integer", "minimum": 0, "maximum": 999}}}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
             "properties": {"color": {"enum": ["red", "green", "blue"]},
                            "ok": {"type": "boolean"}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["tags"],
              "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": {"type": "string", "maxLength": 4}}}},
    # NOTE: integers: a noise model may write a JSON number's fraction digits forever
    "numbers": {"type": "object", "additionalProperties": False, "required": ["x", "n"],
                "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                               "n": {"type": "integer", "minimum": 1, "maximum": 5}}},
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def rank(ckpt):
    yield from colocated_rank(ckpt)


def colocated_rank(ckpt):
    """A colocated rank in-process (TP 1, no Ray) that batches N requests."""
    scheduler = SchedulerConfig(block_size=16, num_kv_blocks=512, chunk_size=256,
                                max_num_batched_tokens=256, max_num_seqs=N)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(ckpt),
                         scheduler=scheduler)
    r = Rank(cfg, 0, ColocatedRole)
    r.start_alone()
    yield r
    r.shutdown()


def run_all(rank, specs, timeout_s=240.0, collect_logprobs=False):
    """request id -> (tokens (``collect_logprobs``: (token, its TokenLogprobs)), finish
    reason, error)."""
    for spec in specs:
        rank.request(Generate(spec))
    out = {s.request_id: ([], None, None) for s in specs}
    deadline = time.monotonic() + timeout_s
    while any(v[1] is None for v in out.values()):
        assert time.monotonic() < deadline, "requests did not finish"
        for ev in rank.poll(0.2):
            toks, _, _ = out[ev.request_id]
            new = list(zip(ev.token_ids, ev.logprobs, strict=True)) if collect_logprobs \
                else list(ev.token_ids)
            out[ev.request_id] = (toks + new, ev.finish_reason, ev.error)
    return out


def _specs(name, grammar, n=N):
    """``n`` greedy requests (different prompts: different outputs, and no per-row draw)."""
    return [RequestSpec(f"{name}-{i}", tuple(range(100 + 7 * i, 110 + 7 * i)),
                        SamplingParams(max_tokens=MAX_TOKENS, grammar=grammar))
            for i in range(n)]


def test_every_json_output_validates_against_its_schema(rank, ckpt):
    tok = Tokenizer(ckpt)
    specs = [s for name, schema in SCHEMAS.items()
             for s in _specs(name, GrammarSpec("json_schema", json.dumps(schema)))]
    plain = RequestSpec("plain", tuple(range(7, 20)), SamplingParams(max_tokens=8,
                                                                      ignore_eos=True))
    solo = run_all(rank, [plain])["plain"]
    got = run_all(rank, [*specs, plain])
    assert got["plain"] == solo  # a batch mate without a grammar is not touched
    for spec in specs:
        tokens, finish, error = got[spec.request_id]
        assert error is None and finish == "stop", (spec.request_id, finish, error)
        doc = json.loads(tok.decode(tokens))
        jsonschema.validate(doc, SCHEMAS[spec.request_id.split("-")[0]])


def test_every_regex_output_matches(rank, ckpt):
    tok = Tokenizer(ckpt)
    got = run_all(rank, _specs("re", GrammarSpec("regex", REGEX), n=20))
    for rid, (tokens, finish, error) in got.items():
        assert error is None and finish == "stop", (rid, finish, error)
        assert re.fullmatch(REGEX, tok.decode(tokens)), tok.decode(tokens)
