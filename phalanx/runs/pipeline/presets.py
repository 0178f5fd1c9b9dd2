"""Pipeline presets: plain functions returning a PipelineRunConfig (listed by `phalanx presets`)."""

from __future__ import annotations

from ...runtime.dp.peer import TrainConfig
from ...runtime.pipeline.config import PipelineConfig
from ...runtime.pipeline.verifier import VerifierConfig
from ...runtime.rounds.btard_state import BTARDConfig
from ...runtime.rounds.butterfly import AllReduceConfig
from .config import PipelineNetworkConfig, PipelineRunConfig


def chars_gpt_pipeline() -> PipelineRunConfig:
    """Character GPT cut in 3: 1 data node (embedding + loss) + 2 stages x 3 relays, SWARM routing, capacity 2.

    1000 iterations of 4 microbatches x 8 windows of 64 characters (about 7 passes over the 300 KB
    corpus): the train loss falls to about 1.6 (unigram entropy 3.27 nats, bigram 2.59); the simulator
    takes about 0.04 s of wall time per iteration on an idle 2-core machine. Each stage clips its gradient
    to norm 1 (pipeline.grad_clip): without it one gradient spike (x500 the usual norm, iterations 10-40)
    stalled learning for hundreds of iterations (1.9 after 1000), and where it struck moved with any
    perturbation (one microbatch lost to churn), so churn runs ended up to 14 % above or below the
    churn-free one (issue-15 s21).
    """
    return PipelineRunConfig(
        preset="chars-gpt-pipeline",
        peers=7,
        data_nodes=1,
        steps=1000,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.003, batch_size=8),
        pipeline=PipelineConfig(stages=2, microbatches=4, capacity=2, complete_timeout=5.0, microbatch_timeout=30.0,
                                iteration_timeout=60.0, aggregation_timeout=10.0, grad_clip=1.0),
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
    The verifiers sit off the data path (`sentinel.hop=off_path`): tensors go straight to their
    receivers, a copy to the link's verifier, and the data node aggregates only microbatches whose
    tensors were cleared (`sentinel.hop=inline` puts every tensor through the verifier, 1.5x slower).
    12 microbatches of 4 windows per iteration and capacity 3, so GWTF's flow uses every relay of a
    stage. lr 0.001, as SENTINEL's tests use: at 0.003 the model still drifts fast when the verifiers'
    warm-up ends (200 tensors, iteration 17), and clean runs had whole stages banned (seed 1). Lying replicas: --set byzantine.attack=agg_shift --set byzantine.relays=0 (relay 0 is in
    stage 1); relays that corrupt activations: --set attack.name=... --set attack.relays=...
    Stage gradients are recomputed: each iteration MPRNG draws 2 validator/target pairs per stage
    (btard.validators=2 of 4 replicas), and a validator recomputes its target's stage gradient from
    the sealed inputs it committed to (issue 18 item 2); a forging replica:
    --set byzantine.attack=approve_all --set byzantine.relays=0.
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
        sentinel=VerifierConfig(enabled=True, placement="boundary", hop="off_path"),
        btard=BTARDConfig(enabled=True, validators=2),
    )


# GWTF Sec. VI / Table II, the paper's numbers and the scaling applied by `gwtf_table2_paper`.
PAPER_ACTIVATION_BYTES = 4 * 512 * 1024 * 4  # a microbatch of 4 x 512 tokens x d_model 1024, float32: 8 MiB
PAPER_BANDWIDTH = (50e6 / 8 / 32, 500e6 / 8 / 32)  # 50-500 Mbit/s divided by 32 ("activations 32 x larger"), B/s
PAPER_STAGE_FLOPS = 3 * (2 * 12 * 1024**2 * 2048 + 4 * 4 * 512**2 * 1024)  # forward of 3 LLaMa blocks, 2048 tokens
A4000_FLOPS = 19.2e12  # RTX A4000 fp32 peak
DEVICE_SHARE = 0.4 / 3.6  # 18 logical nodes on 5 GPUs (3.6 per GPU), at 40% of peak: 2.1 TFLOP/s per node
WIRE_SCALE = 32  # activations and bandwidth both divided by this (small control messages stay cheap)
OUR_STAGE_FLOPS = 2 * 8 * 64 * 64 + 8 * 64 * 2  # forward of one digits-MLP relay stage (64 wide, batch 8)


def gwtf_table2_paper() -> PipelineRunConfig:
    """GWTF Table II in the paper's regime: 2 data nodes x 4 microbatches, 5 relay stages + the data nodes' stage.

    Paper (Sec. VI): 18 nodes, 6 stages (stage 0 on the data nodes), LLaMa-like d_model 1024, 3 blocks per
    stage, microbatches of 4 x 512 tokens, 50-500 Mbit/s divided by 32, capacity 4 (homogeneous) or 1-3
    (heterogeneous: capacity_min=1 capacity_max=3), join-leave chance 0/10/20% per relay and iteration.
    Scaling applied (the model is a digits MLP, one 64-wide layer per stage):
    - hop time: an activation or gradient weighs 8 MiB / 32 = 256 KiB on the wire (padded) over links of
      50-500 Mbit/s / 32 / 32 = 6.1-61 KB/s, i.e. the paper's 8 MiB over 0.2-2 MB/s: 4.3-43 s per hop,
      plus 50 ms latency (the paper does not give its latency);
    - compute: a relay stage is charged the paper's forward FLOPs (3 blocks, 2048 tokens: 168 GFLOP;
      backward twice that) at 19.2 TFLOP/s (A4000 fp32) x 0.4 / 3.6 = 2.1 TFLOP/s: 0.08 s forward;
      communication dominates, as in the paper;
    - capacity: per-iteration slots; what finds no slot is deferred to the next iteration;
    - aggregation moves our stage parameters (16 KB), not the paper's (about 150 MB).
    """
    share = A4000_FLOPS * DEVICE_SHARE
    low, high = PAPER_BANDWIDTH
    return PipelineRunConfig(
        preset="gwtf-table2-paper",
        peers=18,
        data_nodes=2,
        steps=25,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=5, microbatches=4, capacity=4, routing="gwtf", capacity_mode="iteration",
                                activation_bytes=PAPER_ACTIVATION_BYTES // WIRE_SCALE,
                                flops_scale=PAPER_STAGE_FLOPS / OUR_STAGE_FLOPS,
                                complete_timeout=300.0, microbatch_timeout=1200.0, iteration_timeout=1800.0,
                                aggregation_timeout=120.0, flow_period=10.0, flow_warmup=200.0),
        network=PipelineNetworkConfig(latency=0.05, bandwidth_min=low / WIRE_SCALE, bandwidth_max=high / WIRE_SCALE,
                                      flops=share),
    )


PIPELINE_PRESETS = {
    "chars-gpt-pipeline": chars_gpt_pipeline,
    "gwtf-table2": gwtf_table2,
    "secure-gpt-pipeline": secure_gpt_pipeline,
    "gwtf-table2-paper": gwtf_table2_paper,
}
