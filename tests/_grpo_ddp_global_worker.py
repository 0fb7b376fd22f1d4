"""One rank of test_grpo.py's "2 processes equal 1 process on the same global batch" check (also run in-process,
unlaunched, for the 1-process side): a GRPO trainer whose generation is replaced by fixed completions, so both
sides step on the same global batch.  Saves the weights after one optimizer step and the prompts each rank got."""

import os
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import test_grpo as T  # noqa: E402

# (name, loss_type, per_device_train_batch_size on 2 processes); num_generations=4: B=8 gives each rank two whole
# groups, which packtools reorders to balance the ranks' prompt tokens (balance_groups="auto"); bnpo (B=4) keeps
# TRL's order (balance_groups=False: TRL normalizes it per rank, so its step depends on the placement); B=2 cuts
# every group across the two ranks (TRL's order: "auto" cannot keep a group on one rank).
CASES = [("grpo", "grpo", 8), ("dapo", "dapo", 8), ("bnpo", "bnpo", 4), ("dapo-split", "dapo", 2)]
VARIANTS = [("trl", False, False), ("packtools", True, False), ("shared", True, True)]


class FixedCompletions:
    """``_generate_and_score_completions`` returning fixed completions for the prompts the sampler handed this rank:
    the ``k``-th copy of a prompt in the global batch (every rank's prompts, in rank order) gets a completion and
    an advantage drawn from a seed of the prompt and ``k`` alone, wherever the sampler placed it;
    ``num_items_in_batch`` and the reference log-probabilities are computed as TRL computes them."""

    def _generate_and_score_completions(self, inputs):
        from accelerate.utils import gather_object

        self.seen_prompts.append([x["prompt"] for x in inputs])
        rank, local = self.accelerator.process_index, len(inputs)
        every = gather_object([x["prompt"] for x in inputs])  # the global batch, rank 0's prompts first
        tok = self.processing_class
        prompts = [tok(x["prompt"], add_special_tokens=False)["input_ids"] for x in inputs]
        completions, advantages = [], []
        for j in range(local):
            here = rank * local + j
            copy = every[:here].count(every[here])
            g = torch.Generator().manual_seed(1000 + 97 * zlib.crc32(every[here].encode()) + copy)
            n = int(torch.randint(1, self.max_completion_length, (1,), generator=g))
            body = torch.randint(2, T.VOCAB, (n,), generator=g).tolist()
            completions.append(body + [T.EOS] if n < self.max_completion_length - 1 else body)
            advantages.append(float(torch.randn((), generator=g)))
        width_p, width_c = max(map(len, prompts)), max(map(len, completions))
        prompt_ids = torch.tensor([[T.PAD] * (width_p - len(p)) + p for p in prompts])
        prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
        completion_ids = torch.tensor([c + [T.PAD] * (width_c - len(c)) for c in completions])
        completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions])
        out = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.tensor(advantages),
            "num_items_in_batch": self.accelerator.gather(completion_mask.sum()).sum(),  # TRL's own line
        }
        if self.beta != 0.0:
            with torch.no_grad():
                out["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                    self.ref_model,
                    torch.cat([prompt_ids, completion_ids], 1),
                    torch.cat([prompt_mask, completion_mask], 1),
                    width_c,
                    batch_size=self.args.per_device_train_batch_size,
                )[0]
        return out


def run(out, world):
    """Every case and variant, one optimizer step each; per-device batch B on 2 processes, 2B on one."""
    import trl

    out = Path(out) / f"rank{os.environ.get('RANK', '0')}"  # no file shared by the ranks (dist starts later)
    results = {}
    for case, loss_type, per_device in CASES:
        for variant, prepared, share in VARIANTS:
            trainer = T.build(  # one directory: the reference is saved before torch.distributed starts
                out,
                prepared=False,
                loss_type=loss_type,
                beta=0.1,
                max_steps=1,
                learning_rate=1.0,
                per_device_train_batch_size=per_device * (2 // world),
            )
            trainer.__class__ = type("FixedGRPOTrainer", (FixedCompletions, trl.GRPOTrainer), {})
            trainer.seen_prompts = []
            if prepared:
                balance = False if loss_type == "bnpo" else "auto"
                T.prepare_grpo_trainer(trainer, share_prompt=share, balance_groups=balance)
            initial = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
            T.train(trainer)
            results[case, variant] = {
                "update": {k: p.detach() - initial[k] for k, p in trainer.model.named_parameters()},
                "prompts": trainer.seen_prompts,
                "world": trainer.accelerator.num_processes,
                "plan": T.plan_summary(trainer),
            }
    return results


if __name__ == "__main__":
    results = run(sys.argv[1], 2)
    torch.save(results, Path(sys.argv[1]) / f"global-rank{os.environ['RANK']}.pt")
    from _workers import end_process_group

    end_process_group()
