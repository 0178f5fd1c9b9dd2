"""Aspis / Aspis+, pure: who computes which file, detection, and the redundancy attack axis.

- designs: subset assignment, Steiner triple systems, design checks, per-iteration permutations
- detection: agreement graph, clique and windowed-degree detection, majority vote aggregation (Alg. 1-3)
- attacks: the redundancy attack axis (ATT-1/2/3 orchestrations), Theorem 1, symbolic distortion counting
"""
