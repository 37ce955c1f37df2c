"""Train the "tiny-tasks" model on CPU and score it through the serving engine.

    python scripts/train_task_model.py --steps 1200 --out jserve/assets/tiny_tasks

Saves an orbax checkpoint (config.json, params/, byte-tokenizer marker) to --out, every
--save-every steps and at the end, then greedy-generates held-out tasks with ``LLM`` and
prints exact-answer accuracy, the fraction that stop with EOS and the correlation between
requested and produced length.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jserve.model.params import num_params  # noqa: E402
from jserve.model.weights import restore_orbax, save_orbax  # noqa: E402
from jserve.tokenizer import ByteTokenizer  # noqa: E402
from jserve.train.length_task import sample_tasks  # noqa: E402
from jserve.train.trainer import TINY_TASKS_CONFIG, TrainConfig, train  # noqa: E402

HELD_OUT_SEED = 10_000  # evaluation draws with this seed (training streams use --seed)


def save(out: Path, params) -> None:
    """Writes next to ``out`` and swaps it in, so a reader never sees half a checkpoint."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_orbax(tmp, TINY_TASKS_CONFIG, jax.tree.map(jnp.asarray, params), tokenizer=ByteTokenizer())
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--out", type=Path, default=Path("jserve/assets/tiny_tasks"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--row-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--eval-n", type=int, default=64, help="held-out tasks to score (0: none)")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue from this orbax checkpoint instead of random weights")
    args = ap.parse_args(argv)
    tc = TrainConfig(steps=args.steps, batch_rows=args.batch_rows, row_len=args.row_len,
                     lr=args.lr, seed=args.seed)
    print(f"config {num_params(TINY_TASKS_CONFIG)} params; {tc}", flush=True)
    t0 = time.perf_counter()
    init = restore_orbax(args.init, TINY_TASKS_CONFIG) if args.init else None
    params, _ = train(tc, params=init, log=lambda s: print(s, flush=True),
                      on_checkpoint=lambda i, p: save(args.out, p),
                      checkpoint_every=args.save_every)
    save(args.out, params)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.0f}s; saved {args.out}",
          flush=True)
    if args.eval_n:
        from jserve import LLM
        from jserve.train.evaluate import evaluate
        llm = LLM(str(args.out), max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                  warmup=False)
        for split in ("test", "all"):  # never-trained lengths; the whole task
            score = evaluate(llm, sample_tasks(args.eval_n, HELD_OUT_SEED, split))
            print(json.dumps({"split": split, "n": score.n, "exact": score.exact,
                              "stopped_eos": score.stopped_eos, "length_corr": score.length_corr,
                              "exact_by_kind": score.exact_by_kind}), flush=True)


if __name__ == "__main__":
    main()
