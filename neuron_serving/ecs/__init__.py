"""ECS deployment of inference units on Trainium: spec, task definitions, unit controller.

See README.md in this directory for the data flow.
"""
