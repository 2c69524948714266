from steadyrl.services.alertbridge.bridge import main
from steadyrl.service import main_guard

main_guard(main)
