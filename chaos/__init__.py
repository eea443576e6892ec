"""Fault injection for elastic training runs, after Jepsen's nemesis.

Faults are data (chaos.faults), caused and healed from outside the training processes by
injectors (chaos.injectors), on seeded schedules (chaos.schedule, chaos.scenarios). The runner
(chaos.runner) runs the main job under a schedule, records the history (chaos.history), always
heals at the end, and checks invariants on what was recorded (chaos.invariants); chaos.report
writes chaos_report.json and chaos_report.png. Entry point: `python -m chaos run SCENARIO ...`.

This package drives the runtime from outside, like an operator: it reads the run's files on
storage and signals processes; it does not import `elastic`.
"""
