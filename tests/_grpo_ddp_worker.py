"""One rank of test_grpo.py's 2-process check: TRL's GRPOTrainer (three cases) and RLOOTrainer as they are, then prepared
(plain and prompt-shared), each trained 2 steps from the same seeds on 2 processes (gloo); the rank's final weights and logs saved.  The
prepared trainers keep TRL's sampler order (balance_groups=False): generation samples per rank, so a group placed
on another rank draws other completions, and the runs compare the forwards, not the sampling."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import test_grpo as T  # noqa: E402


def main(out):
    out = Path(out)
    steps = dict(beta=0.1, num_iterations=2, gradient_accumulation_steps=2)
    cases = {
        "grpo": dict(loss_type="dapo", **steps),
        "gspo": dict(
            loss_type="grpo", importance_sampling_level="sequence", top_entropy_quantile=0.3, **steps
        ),
        "truncated": dict(mask_truncated_completions=True, max_completion_length=5, steps_per_generation=2),
        "rloo": dict(trainer="rloo", max_steps=1, **steps),
    }
    results = {}
    variants = (("trl", False, False), ("packtools", True, False), ("shared", True, True))
    for (kind, case), (name, prepared, share) in ((c, v) for c in cases.items() for v in variants):
        trainer = T.train(T.build(out / kind / name, prepared, share=share, balance=False, **case))
        results[kind, name] = {
            "params": {k: p.detach().clone() for k, p in trainer.model.named_parameters()},
            "logs": trainer.state.log_history,
            "world": trainer.accelerator.num_processes,
        }
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
    from _workers import end_process_group

    end_process_group()
