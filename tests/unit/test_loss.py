"""Loss and advantage maths of the learner (pure tensors, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.learner.loss import KL_CLAMP, Baseline, advantages, policy_loss


def _grad(kind: str, logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
          **kw: float) -> tuple[torch.Tensor, object]:
    x = logp_new.clone().requires_grad_(True)
    loss, stats = policy_loss(x, logp_old, mask, adv, kind=kind, tis_cap=kw.get("cap", 2.0),
                              ppo_eps=kw.get("eps", 0.2), token_normalizer=float(mask.sum()))
    loss.backward()
    return x.grad, stats


def test_on_policy_tis_and_ppo_equal_reinforce() -> None:
    torch.manual_seed(0)
    logp = -torch.rand(3, 5) * 4  # [B, T]
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    adv = torch.tensor([1.0, -0.5, 2.0])
    g_tis, s = _grad("tis", logp, logp, adv, mask)
    g_ppo, _ = _grad("ppo", logp, logp, adv, mask)
    reinforce = -(adv[:, None] * mask) / mask.sum()  # d/dlogp of -adv*logp/N
    assert torch.allclose(g_tis, reinforce, atol=1e-6), (g_tis, reinforce)
    assert torch.allclose(g_ppo, reinforce, atol=1e-6), (g_ppo, reinforce)
    assert s.clipped == 0 and abs(s.ratio_sum / s.tokens - 1) < 1e-6
    assert g_tis[2, 3:].abs().sum() == 0, "masked tokens must get no gradient"


def test_tis_truncates_large_ratios() -> None:
    logp_old = torch.full((1, 4), -5.0)
    logp_new = torch.tensor([[-5.0, -4.0, -3.0, -5.0 + math.log(1.5)]])  # ratios 1, e, e^2, 1.5
    adv = torch.tensor([1.0])
    g, s = _grad("tis", logp_new, logp_old, adv, torch.ones(1, 4), cap=2.0)
    weights = -g[0] * 4  # gradient = -weight * adv / N
    assert torch.allclose(weights, torch.tensor([1.0, 2.0, 2.0, 1.5]), atol=1e-5), weights
    assert s.clipped == 2, f"2 of 4 tokens above the cap, counted {s.clipped}"


def test_ppo_clip_stops_gradient_outside_the_trust_region() -> None:
    logp_old = torch.zeros(2, 1) - 3.0
    logp_new = torch.tensor([[-3.0 + math.log(1.5)], [-3.0 + math.log(0.5)]])  # ratios 1.5 and 0.5
    # positive advantage: above 1+eps no gradient; negative advantage: below 1-eps no gradient
    g, s = _grad("ppo", logp_new, logp_old, torch.tensor([1.0, -1.0]), torch.ones(2, 1), eps=0.2)
    assert torch.all(g == 0), g
    assert s.clipped == 2
    g2, s2 = _grad("ppo", logp_new, logp_old, torch.tensor([-1.0, 1.0]), torch.ones(2, 1), eps=0.2)
    assert torch.all(g2 != 0), "inside the pessimistic branch the ratio gradient flows"
    assert s2.clipped == 0


def test_kl_penalty_is_zero_at_the_reference_and_positive_away() -> None:
    logp = -torch.rand(2, 3) - 1
    mask = torch.ones(2, 3)
    adv = torch.zeros(2)
    _, s0 = policy_loss(logp, logp, mask, adv, kind="tis", tis_cap=2, ppo_eps=0.2, token_normalizer=6,
                        logp_ref=logp, kl_coef=0.5)
    assert s0.kl_sum == pytest.approx(0.0, abs=1e-7)
    x = (logp + 0.3).requires_grad_(True)
    loss, s1 = policy_loss(x, logp, mask, adv, kind="tis", tis_cap=2, ppo_eps=0.2, token_normalizer=6,
                           logp_ref=logp, kl_coef=0.5)
    loss.backward()
    assert s1.kl_sum > 0 and loss.item() > 0
    assert torch.all(x.grad > 0), "the KL gradient pushes logp back down towards the reference"


def test_kl_of_a_token_far_below_the_reference_is_capped() -> None:
    # one sampled token the policy has pushed 12 nats below the base: k3 would be e^12 ~ 1.6e5
    logp_ref = torch.tensor([[-1.0, -1.0]])
    x = torch.tensor([[-13.0, -1.5]], requires_grad=True)
    loss, s = policy_loss(x, logp_ref, torch.ones(1, 2), torch.zeros(1), kind="tis", tis_cap=2, ppo_eps=0.2,
                          token_normalizer=2, logp_ref=logp_ref, kl_coef=1.0)
    loss.backward()
    assert s.kl_sum == pytest.approx(KL_CLAMP + math.exp(0.5) - 0.5 - 1, rel=1e-5)
    assert x.grad[0, 0] == 0, "beyond the cap a token adds a constant, no gradient"
    assert x.grad[0, 1] < 0, "below the cap the KL still pulls logp up towards the reference"


def test_an_exact_kl_given_per_position_replaces_k3_capped_alike() -> None:
    logp = -torch.rand(2, 3) - 1
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = torch.tensor([[0.2, 12.0, 5.0], [0.0, 0.1, 0.3]], requires_grad=True)  # [B, T]; position (0, 2) is padding
    loss, s = policy_loss(logp, logp, mask, torch.zeros(2), kind="tis", tis_cap=2, ppo_eps=0.2, token_normalizer=5,
                          logp_ref=None, kl_coef=0.5, kl_exact=kl)
    loss.backward()
    assert s.kl_sum == pytest.approx(0.2 + KL_CLAMP + 0.0 + 0.1 + 0.3, rel=1e-6), "masked out, and capped at KL_CLAMP"
    assert loss.item() == pytest.approx(0.5 * s.kl_sum / 5, rel=1e-6)
    assert kl.grad is not None and kl.grad[0, 1] == 0 and kl.grad[0, 2] == 0 and kl.grad[1, 0] == pytest.approx(0.1)


def test_micro_batches_sum_to_the_full_batch_gradient() -> None:
    torch.manual_seed(1)
    logp_new, logp_old = -torch.rand(6, 4) * 3, -torch.rand(6, 4) * 3
    mask = (torch.rand(6, 4) > 0.2).float()
    adv = torch.randn(6)
    full, _ = _grad("tis", logp_new, logp_old, adv, mask)
    x = logp_new.clone().requires_grad_(True)
    n = float(mask.sum())
    for part in (slice(0, 2), slice(2, 6)):
        loss, _ = policy_loss(x[part], logp_old[part], mask[part], adv[part], kind="tis", tis_cap=2.0, ppo_eps=0.2,
                              token_normalizer=n)
        loss.backward()
    assert torch.allclose(x.grad, full, atol=1e-7)


def test_group_relative_advantages_use_the_other_members_of_the_group() -> None:
    adv = advantages([1.0, 0.0, 0.0, 0.0, 5.0], ["a"] * 5, ["g1", "g1", "g2", "g2", None], None,
                     group_relative=True, normalize=False)
    assert adv[:4] == [1.0, -1.0, 0.0, 0.0], "leave-one-out: each row of a pair against the other"
    assert adv[4] == 5.0, "no baseline and no group: the reward itself"


def test_running_baseline_is_per_task_type_and_persists() -> None:
    b = Baseline(momentum=0.5, means={})
    first = advantages([1.0, 0.0, 10.0], ["a", "a", "b"], [None] * 3, b, group_relative=True, normalize=False)
    assert first == [0.5, -0.5, 0.0], "first batch: the batch mean of each task type"
    assert b.means == {"a": 0.5, "b": 10.0}
    second = advantages([1.0, 1.0], ["a", "a"], [None, None], b, group_relative=True, normalize=False)
    assert second == [0.5, 0.5], "second batch: the running mean from before the batch"
    assert b.means["a"] == pytest.approx(0.75)


def test_normalised_advantages_have_unit_scale_but_keep_sign() -> None:
    adv = advantages([3.0, 1.0, 0.0, 0.0], ["a"] * 4, [None] * 4, Baseline(0.9, {"a": 1.0}),
                     group_relative=True, normalize=True)
    raw = [2.0, 0.0, -1.0, -1.0]
    mean = sum(raw) / 4
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 3)
    assert adv == pytest.approx([a / std for a in raw], rel=1e-5)


def test_batch_baseline_centres_each_task_type_in_every_batch() -> None:
    # a running mean from a better past (0.9) would make every row of a worse batch negative
    b = Baseline(momentum=0.9, means={"a": 0.9, "b": 0.9})
    adv = advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], ["a", "a", "a", "a", "b", "b"], [None] * 6, b,
                     group_relative=True, normalize=False, batch_baseline=True)
    # leave-one-out: 1 - 0/3 and 0 - 1/3, i.e. 4/3 of the mean-centred [0.75, -0.25, -0.25, -0.25]
    assert adv == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0])
    assert sum(adv[:4]) == pytest.approx(0.0), "the advantages of a task type sum to zero"
    assert b.means["a"] == pytest.approx(0.9 * 0.9 + 0.1 * 0.25), "the running mean is still tracked"


def test_equal_rewards_are_not_blown_up_by_normalisation() -> None:
    # all rows failed: the standard deviation is 0, and dividing by it made advantages of -2e5
    running = advantages([0.0] * 4, ["a"] * 4, [None] * 4, Baseline(0.9, {"a": 0.3}),
                         group_relative=True, normalize=True)
    assert running == pytest.approx([-0.3] * 4)
    batch = advantages([0.0] * 4, ["a"] * 4, [None] * 4, None, group_relative=True, normalize=True,
                       batch_baseline=True)
    assert batch == [0.0] * 4


def _seq_grad(logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, rows: float) -> torch.Tensor:
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, logp, mask, adv, kind="tis", tis_cap=2.0, ppo_eps=0.2, token_normalizer=rows,
                          agg="sequence")
    loss.backward()
    return x.grad


def test_sequence_aggregation_weighs_every_row_the_same() -> None:
    logp = -torch.rand(2, 6) - 0.5
    mask = torch.ones(2, 6)
    mask[0, 2:] = 0  # a 2-token row next to a 6-token row
    adv = torch.tensor([1.0, -1.0])
    g = _seq_grad(logp, mask, adv, rows=2.0)
    # each row's tokens share 1/(rows * its length): the short row's total pull equals the long row's
    assert g[0].sum() == pytest.approx(-0.5) and g[1].sum() == pytest.approx(0.5)
    assert torch.allclose(g[0, :2], torch.full((2,), -0.25)) and g[0, 2:].abs().sum() == 0
    # under token aggregation the long row dominates: 6 of the 8 tokens
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, logp, mask, adv, kind="tis", tis_cap=2.0, ppo_eps=0.2, token_normalizer=8.0)
    loss.backward()
    assert x.grad[1].sum() == pytest.approx(6 / 8) and x.grad[0].sum() == pytest.approx(-2 / 8)


def test_sequence_aggregation_micro_batches_sum_to_the_full_batch_gradient() -> None:
    torch.manual_seed(2)
    logp = -torch.rand(5, 4) * 3
    mask = (torch.rand(5, 4) > 0.3).float()
    mask[:, 0] = 1.0
    adv = torch.randn(5)
    full = _seq_grad(logp, mask, adv, rows=5.0)
    x = logp.clone().requires_grad_(True)
    for part in (slice(0, 3), slice(3, 5)):
        loss, _ = policy_loss(x[part], logp[part], mask[part], adv[part], kind="tis", tis_cap=2.0, ppo_eps=0.2,
                              token_normalizer=5.0, agg="sequence")
        loss.backward()
    assert torch.allclose(x.grad, full, atol=1e-7)


def test_unknown_aggregation_is_refused() -> None:
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1), kind="tis", tis_cap=2.0,
                    ppo_eps=0.2, token_normalizer=1.0, agg="mean")


def test_positive_only_keeps_rows_above_their_baseline_and_zeroes_the_rest() -> None:
    rewards = [1.0, 0.0, 0.0, -0.5, 0.15, 1.15]
    types = ["tool_use"] * 4 + ["research"] * 2
    signed = advantages(rewards, types, [None] * 6, None, group_relative=True, normalize=True, batch_baseline=True)
    pos = advantages(rewards, types, [None] * 6, None, group_relative=True, normalize=True, batch_baseline=True,
                     positive_only=True)
    assert pos == [max(a, 0.0) for a in signed], "the same scale as the signed advantages, negatives cut to 0"
    assert [a > 0 for a in pos] == [True, False, False, False, False, True]
    assert pos[4] == 0.0, "a shaping-only reward below its task type's batch mean is not reinforced"


def test_the_batch_baseline_leaves_the_row_out() -> None:
    rewards = [1.0, 0.0, 0.0, 0.5, 0.2, 0.8]
    types = ["a"] * 4 + ["b"] * 2
    adv = advantages(rewards, types, [None] * 6, None, group_relative=True, normalize=False, batch_baseline=True)
    others = [(0.0 + 0.0 + 0.5) / 3, (1.0 + 0.0 + 0.5) / 3, (1.0 + 0.0 + 0.5) / 3, 1.0 / 3, 0.8, 0.2]
    assert adv == pytest.approx([r - b for r, b in zip(rewards, others)]), adv
    for rows in (slice(0, 4), slice(4, 6)):  # n/(n-1) times the advantage against the mean of all n
        group = rewards[rows]
        k = len(group)
        centred = [r - sum(group) / k for r in group]
        assert adv[rows] == pytest.approx([k / (k - 1) * c for c in centred]), (adv[rows], centred)


def test_a_lone_row_uses_the_running_mean_then_the_rest_of_the_batch() -> None:
    rewards, types = [1.0, 0.0, 0.0, 0.6], ["a", "a", "a", "b"]
    running = Baseline(0.9, {"b": 0.2})
    adv = advantages(rewards, types, [None] * 4, running, group_relative=True, normalize=False, batch_baseline=True)
    assert adv[3] == pytest.approx(0.6 - 0.2), "b is alone in the batch: its running mean from earlier batches"
    fresh = advantages(rewards, types, [None] * 4, Baseline(0.9, {}), group_relative=True, normalize=False,
                       batch_baseline=True)
    assert fresh[3] == pytest.approx(0.6 - 1 / 3), "b never seen: the mean of the other rows of the batch"
    none = advantages(rewards, types, [None] * 4, None, group_relative=True, normalize=False, batch_baseline=True)
    assert none[3] == pytest.approx(0.6 - 1 / 3), "no running baseline at all: the same"
    assert advantages([0.7], ["a"], [None], None, group_relative=True, normalize=True, batch_baseline=True) == [0.0]
    grouped = advantages([1.0, 0.0, 0.4], ["a", "a", "a"], ["g", "g", None], None, group_relative=True,
                         normalize=False, batch_baseline=True)
    assert grouped == pytest.approx([1.0, -1.0, 0.4 - 0.5]), "a pair's baseline is its partner, before the task type"


def test_a_penalised_row_is_never_reinforced() -> None:
    # a successful session (1.0) whose first call was malformed (-0.5 penalty) next to clean rows
    rewards = [0.5, 1.0, 0.0, 0.0, -0.5]
    penalties = [-0.5, 0.0, 0.0, 0.0, -0.5]
    types = ["tool_use"] * 5
    kw = dict(group_relative=True, normalize=False, batch_baseline=True)
    plain = advantages([1.0, 1.0, 0.0, 0.0, 0.0], types, [None] * 5, None, **kw)  # type: ignore[arg-type]
    signed = advantages(rewards, types, [None] * 5, None, penalties=penalties, **kw)  # type: ignore[arg-type]
    assert signed[1:4] == pytest.approx(plain[1:4]), "the clean rows' baselines use the rewards without penalties"
    assert signed[0] == pytest.approx(min(plain[0], 0.0) - 0.5) and signed[0] < 0, signed
    assert signed[4] == pytest.approx(plain[4] - 0.5), "a failed penalised row keeps its negative A and the penalty"
    pos = advantages(rewards, types, [None] * 5, None, penalties=penalties, positive_only=True, **kw)  # type: ignore[arg-type]
    assert pos[0] == pytest.approx(-0.5) and pos[4] == pytest.approx(-0.5), f"positive_only keeps the penalty: {pos}"
    assert pos[1:4] == pytest.approx([max(a, 0.0) for a in plain[1:4]]), pos


def test_normalisation_scales_penalised_rows_by_the_same_std() -> None:
    rewards, penalties = [1.0, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, -0.5]
    earned = [1.0, 0.0, 0.0, 1.0]
    raw = advantages(earned, ["a"] * 4, [None] * 4, None, group_relative=True, normalize=False, batch_baseline=True)
    mean = sum(raw) / 4
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 3)
    adv = advantages(rewards, ["a"] * 4, [None] * 4, None, group_relative=True, normalize=True, batch_baseline=True,
                     penalties=penalties)
    assert adv[:3] == pytest.approx([a / std for a in raw[:3]]), (adv, raw, std)
    assert adv[3] == pytest.approx((min(raw[3], 0.0) - 0.5) / std), (adv, raw, std)
