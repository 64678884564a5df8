from gpu_jobs.online.canary import *  # noqa: F401,F403  moved; remove once tests/readme_serving.py imports it
