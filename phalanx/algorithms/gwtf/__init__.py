"""GWTF, pure: the decentralized flow that routes microbatches, and where joiners go.

- flow: `FlowNode`, the flow state machine (Sec. IV, V-A, V-C), built from state, request_flow (Request Flow),
  moves (Change / Redirect), handover (a chain changes data node), annealing, costs (Eq. 1), config and
  messages; sync: a synchronous driver
- flowgraph: static staged graphs, the networkx min-cost-flow optimum, SWARM's greedy choice (flow tests)
- placement: the leader among data nodes, flooded stage utilization, joiner placement and its baselines (V-B)
"""
