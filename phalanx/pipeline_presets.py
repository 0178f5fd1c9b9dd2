"""Pipeline presets: plain functions returning a PipelineRunConfig (listed by `phalanx presets`)."""

from __future__ import annotations

from .pipeline_config import PipelineNetworkConfig, PipelineRunConfig
from .runtime.dp_peer import TrainConfig
from .runtime.pipeline.config import PipelineConfig


def chars_gpt_pipeline() -> PipelineRunConfig:
    """Character GPT cut in 3: 1 data node (embedding + loss) + 2 stages x 3 relays, SWARM routing, capacity 2.

    1000 iterations of 4 microbatches x 8 windows of 64 characters (about 7 passes over the 300 KB
    corpus): the train loss falls to about 1.9 (unigram entropy 3.27 nats, bigram 2.59); the simulator
    takes about 0.04 s of wall time per iteration on an idle 2-core machine.
    """
    return PipelineRunConfig(
        preset="chars-gpt-pipeline",
        peers=7,
        data_nodes=1,
        steps=1000,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.003, batch_size=8),
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=2, complete_timeout=5.0, microbatch_timeout=30.0,
                                iteration_timeout=60.0, aggregation_timeout=10.0),
        network=PipelineNetworkConfig(flops=200e9),
    )


def gwtf_table2() -> PipelineRunConfig:
    """GWTF's crash setup at laptop scale: 2 data nodes x 4 microbatches, 6 stages x 3 relays, capacity 4, 50-500 Mbit/s scaled.

    Digits MLP with one hidden layer per stage; compute is charged x flops_scale so a stage
    takes about 1 s per microbatch, and link bandwidths are 50-500 Mbit/s divided by 1000
    (our activations are about 1000x smaller than the paper's), so a hop costs 0.03-0.3 s as
    communication does against compute in the paper. Heterogeneous: capacity_min=1 capacity_max=3.
    Churn: faults.leave_rate / faults.join_rate per relay and iteration (0, 0.1, 0.2 in Table II).
    """
    return PipelineRunConfig(
        preset="gwtf-table2",
        peers=20,
        data_nodes=2,
        steps=10,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=6, microbatches=4, capacity=4, routing="gwtf", flops_scale=7.5e5,
                                complete_timeout=20.0, microbatch_timeout=60.0, iteration_timeout=120.0, flow_period=2.0,
                                aggregation_timeout=20.0),
        network=PipelineNetworkConfig(latency=0.02, bandwidth_min=6.25e3, bandwidth_max=62.5e3, flops=50e9),
    )


PIPELINE_PRESETS = {
    "chars-gpt-pipeline": chars_gpt_pipeline,
    "gwtf-table2": gwtf_table2,
}
