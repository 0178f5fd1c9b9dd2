"""SENTINEL, pure: statistics that verify the traffic between pipeline stages, and the link attack axis.

- statistics: EMAs, distances, Tukey fences, strikes, gradient substitution
- attacks: the link attack axis (what a malicious relay sends instead of its honest tensors)
"""
