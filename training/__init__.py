"""odma-train: the length predictor's training, calibration, evaluation and export."""
