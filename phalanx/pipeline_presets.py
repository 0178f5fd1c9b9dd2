"""Pipeline presets: plain functions returning a PipelineRunConfig (listed by `phalanx presets`)."""

from __future__ import annotations

from .pipeline_config import PipelineNetworkConfig, PipelineRunConfig
from .runtime.btard import BTARDConfig
from .runtime.butterfly import AllReduceConfig
from .runtime.dp_peer import TrainConfig
from .runtime.pipeline.config import PipelineConfig
from .runtime.pipeline.verifier import VerifierConfig


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


def secure_gpt_pipeline() -> PipelineRunConfig:
    """Character GPT in 4: 1 data node + 3 stages x 4 relays, GWTF routing, SENTINEL boundary verifiers, BTARD per stage.

    Both axes of defence at once: verifiers on the links between stages (SENTINEL) and the secure
    round (BTARD: commitments, CenteredClip, V1-V3, ACCUSE / ELIMINATE) in each stage's all-reduce.
    12 microbatches of 4 windows per iteration and capacity 3, so GWTF's flow uses every relay of a
    stage. lr 0.001, as SENTINEL's tests use: at 0.003 the model still drifts fast when the verifiers'
    warm-up ends (200 tensors, iteration 17), and clean runs had whole stages banned (seed 1). Lying replicas: --set byzantine.attack=agg_shift --set byzantine.relays=0 (relay 0 is in
    stage 1); relays that corrupt activations: --set attack.name=... --set attack.relays=...
    Stage gradients are not recomputed by validators yet (btard.validators=0, issue 18 item 2).
    """
    return PipelineRunConfig(
        preset="secure-gpt-pipeline",
        peers=13,
        data_nodes=1,
        steps=40,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.001, batch_size=4),
        pipeline=PipelineConfig(stages=3, microbatches=12, capacity=3, routing="gwtf", complete_timeout=5.0,
                                microbatch_timeout=30.0, iteration_timeout=60.0, aggregation_timeout=20.0),
        allreduce=AllReduceConfig(reducer="centered_clip", tau=1.0),
        network=PipelineNetworkConfig(flops=200e9),
        sentinel=VerifierConfig(enabled=True, placement="boundary"),
        btard=BTARDConfig(enabled=True, validators=0),
    )


PIPELINE_PRESETS = {
    "chars-gpt-pipeline": chars_gpt_pipeline,
    "gwtf-table2": gwtf_table2,
    "secure-gpt-pipeline": secure_gpt_pipeline,
}
