"""`phalanx bench NAME`: the experiments of the papers, at laptop scale. Each module has `run_cli(args)`.

- robustness: aggregators x attacks with a trusted server (BTARD Fig. 3 baselines)
- btard: BTARD's Figure 3 in the simulator; btard_redteam: random multi-point strategies against the round
- gwtf: flow (Table V) and join (Table IV / Fig. 5); gwtf_table2, gwtf_table2_paper: Table II under churn
- pipeline_soak: the pipeline under sustained churn
- secure_pipeline: BTARD per stage + SENTINEL + GWTF against each attack, beside the plain pipeline (issue 18)
- sentinel: SENTINEL's Table 1 (sentinel_sim: its simulator cells; sentinel_variants: shared by both engines)
- aspis: distortion fraction, accuracy, detection and coordinator time
"""
