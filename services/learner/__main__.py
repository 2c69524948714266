from steadyrl.service import main_guard
from steadyrl.services.learner.main import main

main_guard(main)
