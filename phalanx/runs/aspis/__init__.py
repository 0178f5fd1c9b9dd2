"""Aspis runs (1 trusted coordinator + K workers).

- config, presets: AspisRunConfig and its sections; the Aspis presets
- run: who is who, and the simulated run
- launch: the coordinator and workers as OS processes over hivemind
"""
