"""phalanx: training on peers nobody vouches for.

Layers, each importing only those below it:
- core: identities, signed envelopes, canonical encoding, clock, seeded streams, errors
- algorithms: pure rules (aggregators, attacks, MPRNG, ban ledger)
- training: datasets, models and the Task interface (pure compute)
- transport: one interface; the deterministic simulator and hivemind behind it
- runtime: protocol rounds and peer roles over a transport (butterfly all-reduce, MPRNG, data-parallel peer)
- config, presets, experiments, cli: what users run
"""

__version__ = "0.1.0"
