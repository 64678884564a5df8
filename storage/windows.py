from gpu_jobs.online.windows import *  # noqa: F401,F403  moved; remove once tests/readme_serving.py imports it
