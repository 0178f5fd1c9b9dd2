"""GWTF, pure: the decentralized flow that routes microbatches, and where joiners go.

- flow: the flow state machine (Request Flow / Change / Redirect, annealing) and a sync driver (Sec. IV, V-A, V-C)
- flowgraph: static staged graphs, the networkx min-cost-flow optimum, SWARM's greedy choice (flow tests)
- placement: the leader among data nodes, flooded stage utilization, joiner placement and its baselines (V-B)
"""
