"""Pipeline-parallel training over churning peers (GWTF / SWARM).

config.py      -- PipelineConfig: stages, microbatches, capacity, timeouts, routing
stages.py      -- StagedModel: a task's model cut into data-node part + relay stages, shapes and costs
messages.py    -- topics, microbatch keys, total parsers (bad bytes become evidence)
routing.py     -- Router interface and SWARM's stochastic wiring
node.py        -- PipelineNode: the state every node shares, made of the parts below
forward.py     -- the forward pass and routing retries (`Held`: a microbatch between forward and backward)
backward.py    -- the backward pass (BROKEN when the previous node is gone)
links.py       -- verifier hops, seals, signed hop records, requests that give up on a peer that leaves
repair.py      -- lost microbatches and broken backwards (GWTF V-D)
aggregation.py -- BEGIN, the stage all-reduce, CAN TAKE (GWTF V-E)
weights.py     -- serving and fetching stage weights, catch-up
membership.py  -- joining a stage, HELLO, bans (evidence, SENTINEL)
stage_btard.py -- BTARD per relay stage (issue 18)
data_node.py   -- the data node: source and sink of microbatches, loss, leader duties, crash repair
relay.py       -- a relay serving one stage
verifier.py    -- SENTINEL's verifier role: boundary verifier nodes, or the data node (client-routed); bans
attacker.py    -- a relay that lies on its links through a link attack policy (experiments)
"""

from .config import PipelineConfig
from .data_node import DataNode
from .relay import Relay
from .routing import Router, SwarmRouter
from .stages import StagedModel

__all__ = ["DataNode", "PipelineConfig", "Relay", "Router", "StagedModel", "SwarmRouter"]
