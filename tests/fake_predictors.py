"""Length predictors for tests: duck-typed (no base class), answering what a test hands them."""

from __future__ import annotations


class Answers:
    """Answers a fixed list of predictions (cut to the batch), or raises when given "fail"."""

    name = "answers"

    def __init__(self, answers):
        self.answers = answers

    def predict(self, requests):
        if self.answers == "fail":
            raise RuntimeError("predictor down")
        return self.answers[: len(requests)]
