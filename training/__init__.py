"""The fit: training window, split, alpha, recipe and target choice, and the inputs of the anchored ridge solve."""
