"""Train a tiny DeepSeek-V3 model and its MTP module on CPU on a structured synthetic corpus,
and write it as an orch checkpoint (used by benchmarks/mtp_bench.py: a random checkpoint
accepts almost no draft).

Corpus: a chain language over the token ids ``2 .. vocab - 1``: each sequence follows one of two
fixed random permutations from a random start (:func:`chain_batch`); which one shows from the
context, so the main model learns the next token and the MTP module the one after.

Training (HF transformers, autograd): the main model is ``DeepseekV3ForCausalLM`` (loss on
``t_{i+1}``); the MTP module is the DeepSeek-V3 report's (sec. 2.2), written here the same
way as :class:`engine.model.MTPLayer`: ``eh_proj([enorm(Emb t_{i+1}); hnorm(h_i)])`` with
``h`` the main model's normed last hidden state, one MoE decoder layer (a one-layer
``DeepseekV3Model`` whose final norm is ``shared_head.norm``), the main lm_head (loss on
``t_{i+2}``). Both losses are summed (MTP weight 1).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Model

from orchestrator.tiny_model import tiny_config_dict


def chain_batch(batch: int, length: int, vocab: int, gen: torch.Generator,
                chains: int = 2) -> torch.Tensor:
    """``[batch, length]`` int64 sequences of a chain language: each sequence follows one of
    ``chains`` fixed random permutations ``f`` of the ids ``2 .. vocab - 1`` from a random
    start, ``t_{i+1} = f(t_i)`` (the permutations are the same for every call: seed 0)."""
    span = vocab - 2
    perm_gen = torch.Generator().manual_seed(0)
    perms = torch.stack([torch.randperm(span, generator=perm_gen) for _ in range(chains)])
    which = torch.randint(0, chains, (batch,), generator=gen)
    out = torch.empty(batch, length, dtype=torch.int64)
    out[:, 0] = torch.randint(0, span, (batch,), generator=gen)
    for i in range(1, length):
        out[:, i] = perms[which, out[:, i - 1]]
    return out + 2


class _MTP(nn.Module):
    """The MTP module for training (module docstring)."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        h = cfg.hidden_size
        block_cfg = DeepseekV3Config.from_dict({**cfg.to_dict(), "num_hidden_layers": 1,
                                                "first_k_dense_replace": 0})
        self.block = DeepseekV3Model(block_cfg)
        self.enorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, L, H]`` each -> ``[B, L, H]`` after ``shared_head.norm`` (the block's norm)."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(hidden)], dim=-1))
        return self.block(inputs_embeds=x).last_hidden_state


def train_tiny_mtp(out_dir: Path, *, steps: int = 300, num_layers: int = 6, vocab: int = 512,
                   batch: int = 16, length: int = 64, lr: float = 3e-3,
                   seed: int = 0, log_every: int = 0) -> tuple[Path, float, float]:
    """Train and write the checkpoint; returns (dir, final main loss, final MTP loss).
    ``log_every``: print the losses every that many steps (0: never)."""
    torch.manual_seed(seed)
    raw = tiny_config_dict(num_layers=num_layers, vocab_size=vocab, mtp_layers=1,
                           max_position_embeddings=512)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    cfg = DeepseekV3Config.from_pretrained(out_dir)
    main, mtp = DeepseekV3ForCausalLM(cfg).train(), _MTP(cfg).train()
    with torch.no_grad():  # NOTE: unit-scale embeddings (HF's 0.02 keeps the main model slow)
        main.model.embed_tokens.weight.normal_(0.0, 1.0)
    params = [*main.parameters(), *mtp.parameters()]
    opt = torch.optim.AdamW(params, lr=lr)
    gen, ce = torch.Generator().manual_seed(seed), nn.CrossEntropyLoss()
    losses = (float("nan"), float("nan"))
    for step in range(steps):
        ids = chain_batch(batch, length, vocab, gen)
        h = main.model(ids).last_hidden_state  # [B, L, H] normed
        logits = main.lm_head(h)
        main_loss = ce(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        g = mtp(main.model.embed_tokens(ids[:, 1:-1]), h[:, :-2])  # row i: h_i, t_{i+1}
        mtp_loss = ce(main.lm_head(g).reshape(-1, vocab), ids[:, 2:].reshape(-1))
        opt.zero_grad()
        (main_loss + mtp_loss).backward()
        opt.step()
        losses = (main_loss.item(), mtp_loss.item())
        if log_every and step % log_every == 0:
            print(f"  step {step}: main loss {losses[0]:.3f}, MTP loss {losses[1]:.3f}",
                  flush=True)
    _write(out_dir, main, mtp, num_layers)
    return out_dir, *losses


def _write(out_dir: Path, main: DeepseekV3ForCausalLM, mtp: _MTP, n: int) -> None:
    """model.safetensors under checkpoint names (MTP under ``model.layers.{n}.*``)."""
    state = {k: v.detach().contiguous() for k, v in main.state_dict().items()}
    prefix = f"model.layers.{n}."
    for k, v in mtp.block.state_dict().items():
        if k.startswith("layers.0."):
            state[prefix + k[len("layers.0."):]] = v.detach().contiguous()
    state[prefix + "shared_head.norm.weight"] = mtp.block.norm.weight.detach().contiguous()
    for name in ("enorm", "hnorm", "eh_proj"):
        state[f"{prefix}{name}.weight"] = getattr(mtp, name).weight.detach().contiguous()
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    t0 = time.perf_counter()
    path, main_loss, mtp_loss = train_tiny_mtp(Path("/tmp/orch-mtp-bench"), steps=300)
    print(f"trained in {time.perf_counter() - t0:.0f} s: main loss {main_loss:.3f}, "
          f"MTP loss {mtp_loss:.3f} -> {path}")
    shutil.rmtree(path)
