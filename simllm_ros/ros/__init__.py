"""ROS 2 layer of simllm_ros: the lifecycle node and its parameter handling (needs rclpy)."""
