"""simllm-bench as a package: systems (ours and the peers), runner (one run), metrics, report.

The command line is simllm_ros.cli.bench (`simllm-bench`, `python -m simllm_ros.cli.bench`);
workloads and results live under benchmark/.
"""
