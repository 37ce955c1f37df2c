"""Draft-model proposals: a small jserve-loadable model with the target's vocabulary runs
in an engine of its own (its own KV page pool, sized like the target's: every sequence slot
at full context) and continues each speculating request greedily for k tokens.

Each round the request's current tokens go to the draft engine as a prompt; its prefix cache
finds the full pages of what it saw last round, so only the newest tokens (under a page plus
what was accepted) are prefilled before k - 1 decodes. The draft engine runs synchronously
inside the target's ``schedule()``: simple and exact, at the cost of k small steps per
target step on the host's critical path.

The draft engine is made by the ``new_engine`` the engine's builder hands over (one more
``LLMEngine``): the engine builds the speculator, so ``jserve.engine.engine`` is not
imported here."""
from __future__ import annotations

from typing import Any, Callable

from jserve.config import ModelConfig
from jserve.engine.config import EngineConfig
from jserve.model.params import Params
from jserve.model.weights import load_model
from jserve.sampling.params import SamplingParams
from jserve.scheduler import Request

# (model config, params, engine config) -> an engine with ``add_request``,
# ``has_unfinished`` and ``step`` (``LLMEngine``; its tokenizer is None).
NewEngine = Callable[[ModelConfig, Params, EngineConfig], Any]


class DraftModelProposer:
    def __init__(self, engine):
        self.engine = engine

    @classmethod
    def load(cls, model: str, target: ModelConfig, config: EngineConfig, max_model_len: int,
             new_engine: NewEngine) -> "DraftModelProposer":
        """Loads ``model`` (a path or a built-in name) into an engine from ``new_engine``;
        ValueError if its vocabulary is not the target's or its context is shorter."""
        cfg, params, _ = load_model(model, lazy=True)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: draft model {model!r} has vocab_size "
                             f"{cfg.vocab_size}, the target {target.vocab_size}; they must "
                             "share the tokenizer")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config: draft model {model!r} holds "
                             f"{cfg.max_position_embeddings} positions, the target serves "
                             f"{max_model_len}")
        pages = -(-max_model_len // config.page_size)
        engine = new_engine(cfg, params, EngineConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max(
                config.max_num_batched_tokens, config.page_size * 2),
            max_prefill_seqs=config.max_prefill_seqs, max_model_len=max_model_len,
            page_size=config.page_size, num_kv_pages=config.max_num_seqs * pages + 1,
            attention_impl=config.attention_impl, async_scheduling=False,
            warmup=config.warmup, compilation_cache_dir=config.compilation_cache_dir))
        return cls(engine)

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` greedy draft tokens continuing each request's tokens."""
        eng = self.engine
        ids = [eng.add_request(list(r.all_token_ids), SamplingParams(
            temperature=0.0, max_tokens=k, ignore_eos=True)) for r, k in zip(reqs, ks)]
        done: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        return [done.get(i, []) for i in ids]
