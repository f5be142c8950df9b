"""Training: the trainer's update, the forward passes and prefix sharing, the policy,
the algorithms and credit assignment, off-policy correction and mixture-of-experts terms."""
