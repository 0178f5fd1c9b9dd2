"""phalanx: training on peers nobody vouches for.

Layers, each importing only those below it:
- core: identities, signed envelopes, canonical encoding, clock, seeded streams, errors
- algorithms: pure rules (aggregators, attacks, MPRNG, ban ledger)
- training: datasets, models and the Task interface (pure compute)
- transport: one interface; the deterministic simulator and hivemind behind it
- runtime: protocol rounds and peer roles over a transport (butterfly all-reduce, MPRNG, data-parallel peer)
- attack_axes, config, pipeline_config, aspis_config, pipeline_presets, presets: configs and presets
- experiments: simulate, launch, benches, reports of every run kind
- kinds, api, cli: what users call (kinds is the table of run kinds the other two dispatch through)

tests/test_layers.py checks the contract: no import upward, no two modules importing each other.
"""

__version__ = "0.1.0"
