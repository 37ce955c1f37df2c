"""Fine-tune tiny-tasks on the quote task (``jserve/train/quote_task.py``): the model of the
document-QA workload in ``scripts/bench_speculative.py``, whose answers copy the prompt.

    python scripts/train_quote_model.py [--steps 300] [--out build/tiny-quote]

Starts from the shipped tiny-tasks checkpoint, trains on quote tasks only (the bench needs
nothing else from it), saves an orbax checkpoint to --out every --save-every steps and at the
end, then greedy-generates held-out passages and prints how many it copies exactly.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from jserve.model.weights import resolve_model_dir, restore_orbax  # noqa: E402
from jserve.train.quote_task import sample_quote  # noqa: E402
from jserve.train.trainer import TINY_TASKS_CONFIG, TrainConfig, train  # noqa: E402
from train_task_model import save  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("build/tiny-quote"))
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--eval-n", type=int, default=16, help="held-out passages to copy")
    a = ap.parse_args(argv)
    tc = TrainConfig(steps=a.steps, batch_rows=a.batch_rows, lr=a.lr, warmup_steps=20,
                     seed=1)
    init = restore_orbax(resolve_model_dir("tiny-tasks"), TINY_TASKS_CONFIG)
    t0 = time.perf_counter()
    params, _ = train(tc, params=init, log=lambda s: print(s, flush=True),
                      on_checkpoint=lambda i, p: save(a.out, p),
                      checkpoint_every=a.save_every, sample=sample_quote)
    save(a.out, params)
    print(f"trained {a.steps} steps in {time.perf_counter() - t0:.0f}s; saved {a.out}")
    if a.eval_n:
        from jserve import LLM, SamplingParams
        from jserve.train.length_task import format_prompt
        llm = LLM(str(a.out), max_model_len=1024, warmup=False)
        tasks = [sample_quote(np.random.default_rng(10_000 + i)) for i in range(a.eval_n)]
        outs = llm.generate([format_prompt(t.prompt) for t in tasks],
                            SamplingParams(temperature=0.0, max_tokens=400))
        exact = sum(o.text == t.answer for o, t in zip(outs, tasks))
        print(f"held-out passages copied exactly: {exact}/{a.eval_n}")


if __name__ == "__main__":
    main()
