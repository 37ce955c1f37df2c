"""Scoring a checkpoint on held-out length tasks through the serving engine (``LLM``), so the
figures are those of the model as served, not of the training forward."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jserve.sampling.params import SamplingParams
from jserve.train.length_task import Task, format_prompt


@dataclasses.dataclass(frozen=True)
class LengthTaskScore:
    n: int
    exact: float          # fraction whose output is exactly the answer
    stopped_eos: float    # fraction that ended with EOS (not max_tokens)
    length_corr: float    # Pearson correlation of answer length and produced length (tokens)
    exact_by_kind: dict[str, float]
    answer_lens: list[int]
    output_lens: list[int]
    outputs: list[str]    # the decoded completions (EOS dropped)


def evaluate(llm, tasks: Sequence[Task], max_tokens: int = 500) -> LengthTaskScore:
    """Greedy-generates every task's answer with ``llm`` (a :class:`jserve.LLM`)."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate([format_prompt(t.prompt) for t in tasks], params)
    eos = set(llm.tokenizer.eos_token_ids)
    exact, stopped, by_kind = [], [], {}
    answer_lens, output_lens, texts = [], [], []
    for task, out in zip(tasks, outs):
        ids = list(out.token_ids)
        ended = bool(ids) and ids[-1] in eos
        text = llm.tokenizer.decode(ids[:-1] if ended else ids)
        ok = ended and text == task.answer
        texts.append(text)
        exact.append(ok)
        stopped.append(ended)
        by_kind.setdefault(task.kind, []).append(ok)
        answer_lens.append(len(llm.tokenizer.encode(task.answer, add_special_tokens=False)))
        output_lens.append(len(ids) - int(ended))
    corr = float(np.corrcoef(answer_lens, output_lens)[0, 1]) if len(tasks) > 1 else float("nan")
    return LengthTaskScore(len(tasks), float(np.mean(exact)), float(np.mean(stopped)), corr,
                           {k: float(np.mean(v)) for k, v in sorted(by_kind.items())},
                           answer_lens, output_lens, texts)
