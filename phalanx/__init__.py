"""phalanx: training on peers nobody vouches for.

Layers, each importing only those below it; inside algorithms, runtime and runs, one subpackage per system:
- core: identities, signed envelopes, canonical encoding, clock, seeded streams, errors
- algorithms: pure rules: robust/ (aggregators, gradient attacks), btard/, gwtf/, sentinel/, aspis/, catchup
- training: datasets, models and the Task interface (pure compute)
- transport: one interface; the deterministic simulator and hivemind behind it
- runtime: roles over a transport: rounds/ (butterfly, BTARD, MPRNG), dp/, pipeline/, aspis/
- runs (configs): runs.config, runs.presets, runs.attack_axes and each kind's config and presets
- runs: per kind (dp/, pipeline/, aspis/) the simulated run, launch and report; one launcher, netns, watch
- benchmarks: `phalanx bench NAME`
- runs.kinds, api, cli: what users call (kinds is the table of run kinds the other two dispatch through)

tests/test_layers.py checks the contract: no import upward, no two modules importing each other.
docs/ARCHITECTURE.md says where each system lives and what adding one touches.
"""

__version__ = "0.1.0"
