"""The data-order ledger: which document pieces every step held, written beside the job and checked across restarts."""
