"""Embedded defaults shared by every process: where the local stack listens and where state lives.

Every process config takes its addresses from here as field defaults, so one FLYWHEEL_* variable
(or flag) moves all of them to a real deployment. Only constants: nothing runs at import.
"""

from __future__ import annotations

KAFKA_BOOTSTRAP = "127.0.0.1:9092"
VLLM_URL = "http://127.0.0.1:8000"
MLFLOW_PORT = 5000
MLFLOW_UI_URL = f"http://127.0.0.1:{MLFLOW_PORT}"
PROXY_URL = "http://127.0.0.1:8100"

VAR_DIR = "var"  # all local state, relative to the working directory
LAKE_ROOT = "var/lake"  # or any pyarrow filesystem URI, e.g. s3://bucket/lake
MODELS_DIR = "var/models"
BASE_MODEL_DIR = "var/models/tiny-base"
POLICIES_DIR = "var/policies"  # published policy version directories (policy-v<N>)
# The embedded tracking store: a sqlite file, readable without any server running.
MLFLOW_TRACKING_URI = "sqlite:///var/mlflow/mlflow.db"
MLFLOW_ARTIFACTS_DIR = "var/mlflow/artifacts"
REGISTERED_MODEL = "flywheel-policy"


