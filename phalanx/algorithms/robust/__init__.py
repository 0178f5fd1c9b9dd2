"""Robust aggregation, shared by every system: the rules and the gradient attacks they are measured against.

- aggregators: mean, CenteredClip (+ residual), medians, trimmed mean, Krum, Bulyan, ...; `rule_parameters`, the
  one (rule, n, f) table
- reducers: the rule a partition owner or a stage applies, by name (CenteredClip with tau/eps/cap, ...)
- attacks: the gradient attack axis (sign flip, ALIE, IPM, min-max, ...)
"""
