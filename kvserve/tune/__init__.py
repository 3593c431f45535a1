"""``kvserve tune``: engine settings searched for a workload under SLOs, in one process."""
