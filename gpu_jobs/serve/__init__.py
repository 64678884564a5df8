"""Moved to gpu_jobs/online/ (remove this folder once tests/readme_serving.py imports gpu_jobs.online.simulate)."""
