"""docs/porting-haiku.md, run as written: Haiku's ImageNet-example loop with
jmp (policy, DynamicLossScale, all_finite, select_tree) against its
fp16_scaling port, bit for bit over 300 steps with injected overflows, and
the model-state figures."""

import docs_snippets
import oracles

hk = oracles.require("haiku")
oracles.require("jmp")
oracles.require("sklearn")


def test_haiku_port_runs_and_matches_jmp():
  namespace = {}
  try:
    ran = docs_snippets.run_page("porting-haiku.md", namespace)
  finally:  # set_policy is global to the process: leave no policy behind
    for cls in (hk.BatchNorm, namespace.get("ResNet")):
      if cls is not None:
        hk.mixed_precision.clear_policy(cls)
  assert ran == len(docs_snippets.blocks("porting-haiku.md"))
  # The blocks assert the bit-for-bit claims; the figures they quote:
  jmp_skipped = namespace["jmp_skipped"]
  assert sum(jmp_skipped) > len(namespace["BAD"])  # backward overflows too
  assert namespace["acc"]["select"] > 0.6  # 0.700 on jax 0.10.2, CPU
