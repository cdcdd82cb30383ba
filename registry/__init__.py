"""Readouts and RLS state versioned in MLflow, promoted by aliases (`challenger`, `champion`)."""
