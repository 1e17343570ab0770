"""The update of the trained roles on one rollout: ppo_policy on the clipped surrogate (with the KL
in the loss where configured) and, with a critic, ppo_value on the clipped value loss; each for
``ppo_epochs`` passes of optimizer steps of ``global_batch_size`` samples."""

from __future__ import annotations

import time
from typing import Dict, List

import torch

from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.errors import NonFiniteError
from megatron_rlhf.models.batches import dealt_by_tokens, micro_batches_of
from megatron_rlhf.models.decoder import groups_of
from megatron_rlhf.models.routing import ROUTES
from megatron_rlhf.roles.losses import policy_loss_fn, policy_stats, reported_metrics, value_loss_fn
from megatron_rlhf.roles.role_set import RoleSet


class PPOUpdate:
    def __init__(self, config: RLHFConfig, roles: RoleSet, vocab_size: int, pad_id: int):
        self.config = config
        self.roles = roles
        self.vocab_size = vocab_size
        self.pad_id = pad_id

    def __call__(self, r, iteration: int, kl_coef: float) -> Dict[str, float]:
        """Train on the rollout ``r`` (rollout.record.Rollout, advantages filled); its metrics."""
        cfg = self.config
        policy_columns = dict(tokens=r.tokens, action_mask=r.action_mask, old_log_probs=r.old_log_probs, advantages=r.advantages)
        if r.correction is not None:  # rollout correction: tokens masked out, and (truncate) weighed
            policy_columns["action_mask"] = r.correction.keep.to(r.action_mask.dtype)
            if cfg.algorithm.rollout_correction.mode == "truncate":
                policy_columns["is_weights"] = r.correction.weights
        if cfg.ppo.kl_in_loss:
            policy_columns["ref_log_probs"] = r.ref_log_probs
        if r.routes is not None:
            policy_columns[ROUTES] = r.routes
        policy_loss = policy_loss_fn(self.vocab_size, cfg.generation.temperature, cfg.ppo, kl_coef, cfg.response_tokens)
        out = {}
        start = time.perf_counter()
        out.update(self._train_role("ppo_policy", policy_columns, r.lengths, policy_loss, "policy", policy_stats(cfg.ppo), iteration))
        if "ppo_value" in self.roles:
            value_columns = dict(tokens=r.tokens, action_mask=r.action_mask, old_values=r.old_values, returns=r.returns)
            value_loss = value_loss_fn(cfg.ppo.value_clip, cfg.ppo.loss_agg_mode, cfg.response_tokens)
            out.update(self._train_role("ppo_value", value_columns, r.lengths, value_loss, "value", ("clipfrac",), iteration))
        out["time/train_s"] = time.perf_counter() - start
        return out

    def _train_role(self, name: str, columns: Dict[str, torch.Tensor], lengths: torch.Tensor, loss_fn, prefix: str,
                    stats, iteration: int) -> Dict[str, float]:
        """ppo_epochs passes over the rollout in optimizer steps of samples_per_step rows; each step's
        rows (``lengths`` [B]: real tokens each) are grouped by length into micro-batches trimmed to
        their own longest row.

        Each epoch's steps are cut from one permutation of the whole rollout (every DP rank's rows,
        gathered in DP-rank order: the data's order), each DP rank taking its share of every step,
        so which rows share a step, and so the update, does not depend on DP."""
        cfg, cut = self.config, self.roles.cut
        role = self.roles[name]
        everything = cut.gather({**columns, "lengths": lengths}, self.pad_id)
        lengths = everything.pop("lengths")
        rows, step_rows = lengths.shape[0], cfg.samples_per_step(name)
        share = step_rows // cut.size
        pipelined = groups_of(role.model).pp.size() > 1
        steps: List[List[Dict[str, torch.Tensor]]] = []  # per optimizer step, its micro-batches' metric sums
        grad_norms, skipped, router_losses = [], 0, []
        with self.roles.resident(name, "training"):
            for epoch in range(cfg.ppo.ppo_epochs):
                # The same order on every rank (whatever the layout).
                order = torch.randperm(rows, generator=torch.Generator().manual_seed(
                    cfg.seed + 7_919 * iteration + 104_729 * epoch)).to(lengths.device)
                for first in range(0, rows, step_rows):
                    step = order[first : first + step_rows]
                    # packed rows cost their real tokens: each DP rank takes an equal share of them
                    picked = step[dealt_by_tokens(lengths[step], cut.size, cut.rank)] if role.config.pack_rows \
                        else step[cut.rank * share : (cut.rank + 1) * share]
                    mbs, _ = micro_batches_of(role.config, lengths[picked], pipelined,
                                              **{k: v[picked] for k, v in everything.items()})
                    result = role.train_step(mbs, loss_fn)
                    where = f"iteration {iteration}, optimizer step {len(steps) + skipped + 1} (epoch {epoch + 1})"
                    if not step_applied(result, cfg, name, where, "extreme rewards or "):
                        skipped += 1
                        continue
                    steps.append(result["metrics"])
                    grad_norms.append(float(result["grad_norm"]))
                    router_losses.append(result["moe"])
        metrics = reported_metrics(steps, prefix, stats, lengths.device, self.roles.figures_group,
                                   groups_of(role.model).pp) \
            if steps else {f"loss/{prefix}": float("nan")}
        grad_norm = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        # Each step's router losses are already the same on every rank: the mean over the steps.
        router = {f"{prefix}/{k}": sum(r[k] for r in router_losses) / len(router_losses) for k in router_losses[0]} \
            if router_losses else {}
        return {**metrics, **router, f"{prefix}/grad_norm": grad_norm, f"{prefix}/skipped_steps": float(skipped)}


def step_applied(result: Dict, config, name: str, where: str, suspects: str = "") -> bool:
    """Whether an optimizer step of ``name`` (``result``: its train_step's) was applied: a
    non-finite loss or gradient stops the run (trainer.on_non_finite: stop; ``where``: the step,
    ``suspects``: causes to look for besides the learning rate) or is skipped (False)."""
    if result["non_finite"] is None:
        return True
    if config.trainer.on_non_finite == "stop":
        raise NonFiniteError(f"{where}: {name}: non-finite {result['non_finite']}; the step was not applied and nothing "
                             f"of it was saved. Look for {suspects}a learning rate too high ({name}.lr="
                             f"{config.role(name).lr}); trainer.on_non_finite: skip skips such steps", collective=True)
    return False
