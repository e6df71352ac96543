"""An example NavigateTo action server (simllm_ros/action/NavigateTo) for the tool-call robot example: it "drives"
to a named place or a point at the goal's speed, sends the distance left as feedback every 0.1 s, and stops at once
when the goal is cancelled (as a cancel of the simllm_node Generate goal that sent it does).

    python examples/navigate_server.py            # serves /navigate_to (config/tools.example.yaml's navigate_to)

Nothing moves: it is the shape of a real server (accept, feedback, cancel, result), for trying the tool calls.
"""
from __future__ import annotations

import math
import threading
import time

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup

PLACES = {"dock": (0.0, 0.0), "kitchen": (4.0, 3.0), "door": (8.0, -1.0)}
TICK_S = 0.1


class NavigateToServer:
    """The server on `node`, at `name`; `outcomes` lists how each goal ended (succeeded, canceled, rejected)."""

    def __init__(self, node, name: str = "/navigate_to", start=(2.0, 2.0)):
        from simllm_ros.action import NavigateTo
        self._NavigateTo = NavigateTo
        self.position = start
        self.outcomes: list[str] = []
        self.running = threading.Event()  # set while a goal drives
        self._server = ActionServer(node, NavigateTo, name, execute_callback=self._drive,
                                    goal_callback=self._accept, cancel_callback=lambda _g: CancelResponse.ACCEPT,
                                    callback_group=ReentrantCallbackGroup())

    def _accept(self, goal) -> GoalResponse:
        ok = (goal.place in PLACES or goal.place == "point") and goal.speed > 0
        if not ok:
            self.outcomes.append("rejected")
        return GoalResponse.ACCEPT if ok else GoalResponse.REJECT

    def _drive(self, gh):
        NavigateTo = self._NavigateTo
        g = gh.request
        target = PLACES.get(g.place, (float(g.target[0]), float(g.target[1])))
        x0, y0 = self.position
        total = math.dist((x0, y0), target)
        driven = 0.0
        self.running.set()
        try:
            while driven < total:
                if gh.is_cancel_requested:
                    gh.canceled()
                    self.outcomes.append("canceled")
                    return NavigateTo.Result(success=False, message=f"stopped {total - driven:.1f} m short",
                                             distance_m=driven)
                driven = min(total, driven + g.speed * TICK_S)
                f = driven / total if total else 1.0
                self.position = (x0 + (target[0] - x0) * f, y0 + (target[1] - y0) * f)
                gh.publish_feedback(NavigateTo.Feedback(distance_remaining=total - driven))
                time.sleep(TICK_S)
            gh.succeed()
            self.outcomes.append("succeeded")
            return NavigateTo.Result(success=True, message=f"arrived at {g.place}", distance_m=total)
        finally:
            self.running.clear()

    def destroy(self) -> None:
        self._server.destroy()


def main() -> None:
    import rclpy
    from rclpy.executors import MultiThreadedExecutor
    rclpy.init()
    node = rclpy.create_node("navigate_to_server")
    NavigateToServer(node)
    executor = MultiThreadedExecutor()
    executor.add_node(node)
    try:
        executor.spin()
    except KeyboardInterrupt:
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
